"""A quantization run's options in one place: ``Recipe``, and GPTQ's two named presets.

``quantize_model(model, recipe, calib)`` reads nothing else: the method, the grid (bits, group size,
symmetric, range search) and GPTQ's and AWQ's options are the fields of one frozen dataclass, checked in
``__post_init__`` (each error names the field). ``Recipe.of`` builds one the way the commands do.

GPTQ's presets (``RECIPES``; ``--recipe paper|best``): ``PAPER`` is the algorithm of Frantar et al. 2023
as its reference code runs it by default (stored column order, min/max ranges, 1% dampening, no true
sequential, no asymmetric calibration); ``BEST`` is the setting measured best on SmolLM2 and the
commands' default (act-order, range search, 0.1% dampening, true sequential, GPTQv2's asymmetric
calibration). They differ in exactly six fields (``PRESET_FIELDS``): ``act_order``, ``mse``, ``percdamp``,
``true_sequential``, ``v2`` and ``v2_percdamp``; ``AWQ_GPTQ`` is ``BEST`` without v2. A preset fixes the
algorithm, not the grid: ``replace(PAPER, bits=3, group_size=-1)`` is the paper's 3-bit per-channel run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .head import head_config
from .rtn import QuantConfig

METHODS = ("rtn", "gptq", "awq", "awq+gptq")
GPTQ_OPTIONS = ("act_order", "static_groups", "percdamp", "v2", "v2_percdamp", "v2_alpha")  # gptq, awq+gptq only
AWQ_OPTIONS = ("awq_clip", "awq_tokens")  # awq, awq+gptq only
PRESET_FIELDS = ("act_order", "mse", "percdamp", "true_sequential", "v2", "v2_percdamp")  # where PAPER and BEST differ
V2_PERCDAMP = 0.3  # GPTQv2's correction dampened by 30% of the mean diagonal of H: BEST's, measured


@dataclass(frozen=True)
class Recipe:
    """How ``quantize_model`` quantizes a model. The defaults are plain: RTN's and AWQ's settings, and GPTQ's
    column loop as the paper has it; a GPTQ run starts from ``PAPER`` or ``BEST``.

    Attributes:
        method: "rtn", "gptq", "awq" (AWQ's scales and clip, then RTN) or "awq+gptq" (AWQ's scales, then GPTQ).
        bits, group_size, sym: the grid (``QuantConfig``; group_size -1: per channel).
        mse: search each group's range instead of its min / max (``QuantConfig.mse``, the GPTQ reference
            quantizer's option).
        true_sequential: calibrate each layer of a block on the outputs of the block's layers before it,
            already quantized; False: all four on one pass of the float block, as the paper.
        act_order, static_groups, percdamp: GPTQ's column loop (``gptq.gptq_quantize``): columns by
            decreasing ``diag(H)``, every group fixed up front, dampening as a fraction of the mean diagonal.
        v2, v2_percdamp, v2_alpha: GPTQv2's asymmetric calibration (``gptq.asymmetric_target``): fit each
            layer to the float model's outputs on the float model's inputs; v2_percdamp dampens the
            correction's solve (a ridge toward the float weight; set with v2 on, None with it off), v2_alpha
            scales the correction.
        awq_clip: AWQ's clip search (Lin et al. 2024, Sec. 3.3); None: on, except for "awq+gptq" with the range
            search, where clipping would replace the float weights GPTQ reproduces (``clip``).
        awq_tokens: tokens sampled for AWQ's searches.
        quant_head: "none" (the output layer stays float, as in GPTQ and AWQ), "int8" or "int4"
            (``head.quantize_output``).

    Raises:
        ValueError: naming the field (bits / group_size as ``QuantConfig`` names them).
    """

    method: str
    bits: int = 4
    group_size: int = 64
    sym: bool = False
    mse: bool = False
    true_sequential: bool = True
    act_order: bool = False
    static_groups: bool = False
    percdamp: float = 0.01
    v2: bool = False
    v2_percdamp: float | None = None
    v2_alpha: float = 1.0
    awq_clip: bool | None = None
    awq_tokens: int = 4096
    quant_head: str = "none"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method: {self.method!r} is not one of {METHODS}")
        QuantConfig(self.bits, self.group_size, self.sym, self.mse)  # checks bits and group_size
        head_config(self.quant_head)  # checks quant_head
        if not 0 <= self.percdamp < 1:
            raise ValueError(f"percdamp: must be in [0, 1) (a fraction of the mean diagonal of H; --percdamp), "
                             f"got {self.percdamp}")
        for name, what in (("act_order", "the column order"), ("static_groups", "groups fixed up front"),
                           ("v2", "asymmetric calibration")):
            if getattr(self, name) and not self.gptq:
                raise ValueError(f"{name}: {what} is a GPTQ option; {self.method} does not use it")
        if self.awq_clip is not None and not self.awq:
            raise ValueError(f"awq_clip: AWQ's clip search; {self.method} does not use it")
        if self.v2_percdamp is not None and not 0 <= self.v2_percdamp < 1:
            raise ValueError(f"v2_percdamp: must be in [0, 1) (a fraction of the mean diagonal of H; --v2-percdamp), "
                             f"got {self.v2_percdamp}")
        if self.v2_percdamp is not None and not self.v2:
            raise ValueError(f"v2_percdamp: dampens GPTQv2's correction, which is off for {self.method} here; turn on "
                             "v2 (--v2) or drop --v2-percdamp")
        if self.v2 and self.v2_percdamp is None:
            raise ValueError(f"v2_percdamp: v2 needs its correction's dampening (BEST's: {V2_PERCDAMP})")
        if not isinstance(self.awq_tokens, int) or self.awq_tokens < 1:
            raise ValueError(f"awq_tokens: must be a positive integer, got {self.awq_tokens!r}")

    @property
    def config(self) -> QuantConfig:
        """The grid every layer is quantized on."""
        return QuantConfig(self.bits, self.group_size, self.sym, self.mse)

    @property
    def gptq(self) -> bool:
        return self.method.endswith("gptq")

    @property
    def awq(self) -> bool:
        return self.method.startswith("awq")

    @property
    def clip(self) -> bool:
        """AWQ's clip search runs: ``awq_clip``, by default on except before GPTQ's range search."""
        return self.awq and (self.awq_clip if self.awq_clip is not None else not (self.gptq and self.mse))

    def report(self) -> dict:
        """The options as they run, under the keys of the commands' JSON and of saved files (an option the
        method does not use is False or None)."""
        return {"method": self.method, "bits": self.bits, "group_size": self.group_size, "sym": self.sym,
                "mse": self.mse, "act_order": self.gptq and self.act_order,
                "static_groups": self.gptq and self.static_groups, "percdamp": self.percdamp if self.gptq else None,
                "true_sequential": self.true_sequential, "v2": self.v2,
                "v2_alpha": self.v2_alpha if self.v2 else None, "v2_percdamp": self.v2_percdamp,
                "awq_clip": self.clip}

    def preset_fields(self) -> dict:
        """{field: value} of ``PRESET_FIELDS``: what a preset chooses."""
        return {k: getattr(self, k) for k in PRESET_FIELDS}

    @classmethod
    def of(cls, method: str, preset: str | None = None, *, config: QuantConfig | None = None, **options) -> Recipe:
        """The recipe the commands build: ``method``'s start, then ``config``'s bits / group size / sym / mse
        and the ``options`` (fields) that are given (None: not given).

        The start: for "gptq" the preset (``RECIPES[preset]``, "best" when None); for "awq+gptq" the same
        without v2 (``AWQ_GPTQ`` for "best"); for "rtn" and "awq" the field defaults. Turning v2 on without a
        dampening takes BEST's; turning it off drops the start's.

        Raises:
            ValueError: a preset or an option that ``method`` does not use ("quant: rtn does not use
                --act-order", named as the flag that sets it), an unknown preset, or what ``__post_init__``
                refuses.
        """
        if config is not None:
            options = {"bits": config.bits, "group_size": config.group_size, "sym": config.sym, "mse": config.mse,
                       **options}
        given = {k: v for k, v in options.items() if v is not None}
        gptq, awq = method.endswith("gptq"), method.startswith("awq")
        unused = (["recipe"] if preset is not None and not gptq else []) + [
            k for k in given if (k in GPTQ_OPTIONS and not gptq) or (k in AWQ_OPTIONS and not awq)]
        if unused and method in METHODS:
            raise ValueError(f"quant: {method} does not use {', '.join('--' + k.replace('_', '-') for k in unused)}; "
                             "drop it, or pick a method that does (gptq and awq+gptq for --recipe/--act-order/"
                             "--static-groups/--percdamp/--v2/--v2-percdamp, awq and awq+gptq for --awq-clip)")
        if preset is not None and preset not in RECIPES:
            raise ValueError(f"recipe: {preset!r} is not one of {tuple(RECIPES)}")
        start = replace(RECIPES[preset or "best"], method=method) if gptq else cls(method)
        if method == "awq+gptq":
            start = replace(start, v2=False, v2_percdamp=None)
        if "v2_percdamp" not in given:
            given["v2_percdamp"] = (start.v2_percdamp or V2_PERCDAMP) if given.get("v2", start.v2) else None
        return replace(start, **given)


PAPER = Recipe("gptq", mse=False, true_sequential=False, act_order=False, percdamp=0.01, v2=False)
BEST = Recipe("gptq", mse=True, true_sequential=True, act_order=True, percdamp=0.001, v2=True,
              v2_percdamp=V2_PERCDAMP)
AWQ_GPTQ = replace(BEST, method="awq+gptq", v2=False, v2_percdamp=None)
RECIPES = {"paper": PAPER, "best": BEST}
