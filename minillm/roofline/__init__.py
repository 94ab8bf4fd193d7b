"""The roofline (Williams, Waterman, Patterson, CACM 2009) of prefill and decode: predicted from a
decoder's config, measured on this machine, set side by side.

    cost.py      the cost model: FLOPs and bytes of a forward, arithmetic intensity, the bound
    ceilings.py  this machine's ceilings (bandwidth, matmul throughput) and ``compare``
    cli.py       ``python -m minillm roofline``

The figures (the roofline, measured over predicted, linear layouts, the compiled decode's waterfall) are
in the lab: ``minillm.lab.roofline_plots``.

The model's own forwards are timed by ``minillm.timing`` (``measure_decode``, ``measure_prefill``,
``measure_verify``), exported here too so that a roofline reads as its own steps.
"""

from ..timing import check_fits, measure_decode, measure_prefill, measure_verify, time_median
from .cost import (DTYPE_BYTES, HARDWARE, LLAMA2_7B, LLAMA2_70B, Cost, Hardware, decode_cost, decode_time_lower_bound,
                   forward_cost, linear_params, prefill_cost)
from .ceilings import Ceilings, compare, measure, measure_weight_read

__all__ = ["DTYPE_BYTES", "HARDWARE", "LLAMA2_70B", "LLAMA2_7B", "Ceilings", "Cost", "Hardware", "check_fits", "compare", "decode_cost",
           "decode_time_lower_bound", "forward_cost", "linear_params", "measure", "measure_decode",
           "measure_prefill", "measure_verify", "measure_weight_read", "prefill_cost",
           "time_median"]
