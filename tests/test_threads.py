"""The thread choice (``minillm.fast.threads``) as pure functions on synthetic readings, and the governor's
respect for a count the user fixed."""

import os
import subprocess
import sys

import pytest
import torch

from minillm.fast import threads
from minillm.fast.threads import Sample, ThreadGovernor, choose_threads, others_busy


@pytest.mark.parametrize("usable, others, expected", [
    (2, 0.0, 2), (2, 0.2, 2), (2, 0.3, 1), (2, 1.0, 1), (2, 6.0, 1),  # a 2-core laptop: quiet, a browser, `yes`
    (8, 0.0, 8), (8, 1.0, 7), (8, 2.6, 5), (8, 7.9, 1), (1, 0.0, 1),
    (2, None, 2), (4, float("nan"), 4), (2, -0.5, 2),  # unknown load: every core; noise below 0 is 0
])
def test_choose_threads(usable, others, expected):
    assert choose_threads(usable, others) == expected


@pytest.mark.parametrize("others", [0.0, 1.0, 6.0, None])
def test_choose_threads_uses_every_core_when_waiting_threads_sleep(others):
    assert choose_threads(2, others, passive=True) == 2


@pytest.mark.parametrize("env, passive", [({}, False), ({"OMP_WAIT_POLICY": "passive"}, True),
                                          ({"OMP_WAIT_POLICY": "ACTIVE"}, False), ({"GOMP_SPINCOUNT": "1000"}, True),
                                          ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"}, False),
                                          ({"GOMP_SPINCOUNT": "0"}, True)])
def test_waits_passively(env, passive):
    assert threads.waits_passively(env) is passive


@pytest.mark.slow  # imports counted from a new interpreter
def test_importing_minillm_leaves_the_wait_policy_to_the_user():
    code = "import os, minillm, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"  # spinning stays (fast on a quiet machine); the governor thins threads when busy
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "PASSIVE"


def test_choose_threads_free_share():
    assert choose_threads(2, 0.5, free_share=0.5) == 2
    assert choose_threads(2, 0.5, free_share=1.0) == 1


@pytest.mark.parametrize("usable, share, field", [(0, 0.75, "usable"), (2, 0.0, "free_share"), (2, 1.5, "free_share")])
def test_choose_threads_refuses(usable, share, field):
    with pytest.raises(ValueError, match=field):
        choose_threads(usable, 0.0, free_share=share)


def test_others_busy_subtracts_this_process():
    # 2 cores, 100 jiffies per core over 1 s: the machine 150 busy of 200 (1.5 cores), this process 0.9 s of CPU
    before, after = Sample(0, 0, 10.0, 100.0), Sample(150, 200, 10.9, 101.0)
    assert others_busy(before, after, cores=2) == pytest.approx(0.6)
    assert others_busy(before, Sample(20, 200, 11.5, 101.0), cores=2) == 0.0  # never below 0
    assert others_busy(before, before, cores=2) is None  # no time passed


def test_read_sample_parses_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 20 0 5 10 0 0\ncpu0 1 2 3 4\n")
    s = threads.read_sample(str(stat))
    assert (s.busy_jiffies, s.total_jiffies) == (170, 990)  # idle and iowait are not busy; steal is
    assert threads.read_sample(str(tmp_path / "missing")) is None


@pytest.fixture(autouse=True)
def _no_fixed_count(monkeypatch):
    """A count fixed by whoever runs the tests (OMP_NUM_THREADS=1) would turn every governor here off."""
    for name in ("MINILLM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def _governor(monkeypatch, readings, cores=2):
    """A governor on 2 cores fed synthetic readings, one per call to read_sample."""
    it = iter(readings)
    monkeypatch.setattr(threads, "read_sample", lambda stat="/proc/stat": next(it))
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    g = ThreadGovernor(interval=0.0)
    g.passive = False  # OpenMP threads spin while they wait: the case the governor is for
    return g


def test_governor_follows_the_load(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        busy = [Sample(0, 0, 0.0, 0.0), Sample(0, 0, 0.0, 0.0), Sample(190, 200, 0.9, 1.0)]  # others: 1 core
        quiet = [Sample(190, 200, 0.9, 1.0), Sample(290, 400, 1.9, 2.0)]  # only this process
        g = _governor(monkeypatch, busy + quiet[1:])
        assert g.fit() == 1 and g.others == pytest.approx(1.0)
        g.tick()
        assert torch.get_num_threads() == 2 and g.last == 2
    finally:
        torch.set_num_threads(before)


def test_governor_leaves_a_users_count_alone(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        g = _governor(monkeypatch, [Sample(0, 0, 0.0, 0.0)] * 2 + [Sample(190, 200, 0.9, 1.0)] * 3)
        torch.set_num_threads(1)  # the user's own choice, after the governor was made
        g.fit()
        assert not g.enabled and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert not _governor(monkeypatch, [Sample(0, 0, 0.0, 0.0)]).enabled and threads.fixed_by_user() == 2
    finally:
        torch.set_num_threads(before)


def test_torch_default_threads_restores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads.GOVERNOR, "enabled", True)
    try:
        torch.set_num_threads(1)
        with threads.torch_default_threads():  # a peer runs as torch would run it alone
            assert torch.get_num_threads() == threads.usable_cores() and not threads.GOVERNOR.enabled
        assert torch.get_num_threads() == 1 and threads.GOVERNOR.enabled
        threads.GOVERNOR.enabled = False  # a count the user fixed stays
        with threads.torch_default_threads():
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
