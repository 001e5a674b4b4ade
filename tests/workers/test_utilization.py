"""Utilisation: aspects under test

- idle accounting: time inside ``waiting`` is counted by reason, shares weight it, a window
  returns fractions of its wall time and starts a new one, the total is capped at 1;
- a colocated step splits into "trainer waits while generating" and "engine waits while
  training" halves, plus pauses and throttling;
- accelerator utilisation is absent (not 0) without NVML; with a device its mean and spread;
- the operator averages the reports per role into status.utilization.
"""

from __future__ import annotations

from typing import Any

import pytest

from rljob_operator.reconcile import build_utilization_status
from rljob_workers.config import Progress
from rljob_workers.utilization import AcceleratorMonitor, IdleAccount, account_colocated_step


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_account_waiting_counts_fraction_of_window() -> None:
    clock = Clock()
    idle = IdleAccount(clock)
    with idle.waiting("wait_experience"):
        clock.now += 3.0
    clock.now += 1.0  # busy: training
    assert idle.window() == {"idle_wait_experience": 0.75, "idle_fraction": 0.75}
    clock.now += 2.0  # a fully busy window
    assert idle.window() == {"idle_fraction": 0.0}


def test_idle_account_share_weights_and_total_is_capped() -> None:
    clock = Clock()
    idle = IdleAccount(clock)
    idle.add("wait_weights", 4.0, share=0.5)
    idle.add("paused", 10.0)
    clock.now += 8.0
    window = idle.window()
    assert window["idle_wait_weights"] == 0.25
    assert window["idle_fraction"] == 1.0


def test_idle_account_unknown_reason_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown idle reason 'coffee'"):
        IdleAccount().add("coffee", 1.0)


def test_colocated_step_halves_idle_in_each_phase() -> None:
    clock = Clock()
    idle = IdleAccount(clock)
    record: dict[str, Any] = {
        "step_time_s": 10.0,
        "generate_time_s": 6.0,
        "paused_s": 1.0,
        "throttle_wait_s": 0.0,
    }
    clock.now += 10.0
    account_colocated_step(idle, record)
    window = idle.window()
    assert window["idle_wait_generation"] == pytest.approx(0.3)  # 6 s x 0.5 / 10 s
    assert window["idle_wait_training"] == pytest.approx(0.15)  # (10 - 6 - 1) x 0.5 / 10
    assert window["idle_paused"] == pytest.approx(0.1)
    assert window["idle_fraction"] == pytest.approx(0.55)


def test_accelerator_monitor_without_nvml_reports_absent() -> None:
    monitor = AcceleratorMonitor()
    try:
        if monitor.available:
            pytest.skip("this machine has a GPU visible to NVML")
        assert monitor.window() == {}
    finally:
        monitor.close()


class ScriptedNvml:
    """A device whose utilisation follows a script (the statistics, not NVML, under test)."""

    def __init__(self, rates: list[int]) -> None:
        self.rates = iter(rates)

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        class Rates:
            gpu = next(self.rates)

        return Rates()


def test_accelerator_monitor_reports_mean_and_fluctuation() -> None:
    monitor = AcceleratorMonitor(interval_s=3600, nvml=ScriptedNvml([40, 100]))
    try:
        assert monitor.window() == {"accelerator_util": 40.0, "accelerator_util_std": 0.0}
        monitor._samples = [20.0, 60.0]  # two background samples
        assert monitor.window() == {"accelerator_util": 40.0, "accelerator_util_std": 20.0}
    finally:
        monitor.close()


def test_utilization_status_averages_per_role_and_omits_absent() -> None:
    reports = [
        Progress(role="rollout", replica=0, time=1.0, idle_fraction=0.2),
        Progress(role="rollout", replica=1, time=1.0, idle_fraction=0.4),
        Progress(role="trainer", replica=0, time=1.0, idle_fraction=0.5, accelerator_util=80.0),
    ]
    assert build_utilization_status(reports) == {
        "rollout": {"idleFraction": 0.3},
        "trainer": {"idleFraction": 0.5, "acceleratorUtilization": 80.0},
    }
    assert build_utilization_status([Progress(role="actor", time=1.0)]) == {}
