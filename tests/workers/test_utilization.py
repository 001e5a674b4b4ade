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
from rljob_workers.utilization import (
    ACCELERATOR_ABSENT_REASONS,
    PHASES,
    AcceleratorMonitor,
    IdleAccount,
    PhaseClock,
    account_colocated_step,
    process_devices,
)


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
        assert monitor.reason in ACCELERATOR_ABSENT_REASONS
    finally:
        monitor.close()


def test_accelerator_monitor_of_a_cpu_process_never_touches_nvml() -> None:
    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"NVML called: {name}")

    monitor = AcceleratorMonitor(nvml=Untouchable(), enabled=False)
    assert (monitor.available, monitor.reason, monitor.window()) == (False, "cpu_device", {})


class ScriptedNvml:
    """Devices whose utilisation follows a script (the statistics, not NVML, under test)."""

    def __init__(self, rates: list[int], count: int = 1) -> None:
        self.rates = iter(rates)
        self.count = count

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise ValueError(f"NVML_ERROR_INVALID_ARGUMENT: index {index}")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return int(uuid.rsplit("-", 1)[1])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        class Memory:
            used = (handle + 1) * 2**30

        return Memory()

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        class Rates:
            gpu = next(self.rates)

        return Rates()


def test_accelerator_monitor_reports_mean_and_fluctuation() -> None:
    monitor = AcceleratorMonitor(interval_s=3600, nvml=ScriptedNvml([40, 100]))
    try:
        memory = {"accelerator_memory_used_bytes": float(2**30)}
        assert monitor.window() == {
            "accelerator_util": 40.0,
            "accelerator_util_std": 0.0,
            **memory,
        }
        monitor._samples = [20.0, 60.0]  # two background samples
        assert monitor.window() == {
            "accelerator_util": 40.0,
            "accelerator_util_std": 20.0,
            **memory,
        }
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


def test_accelerator_monitor_watches_only_the_process_gpus() -> None:
    """NVML sees every GPU of the pod: a rank watches its own (index or UUID), not all."""
    by_index = AcceleratorMonitor(interval_s=3600, nvml=ScriptedNvml([50], count=4), devices=["2"])
    by_uuid = AcceleratorMonitor(
        interval_s=3600, nvml=ScriptedNvml([50, 50], count=4), devices=["GPU-aa-1", "GPU-bb-3"]
    )
    everything = AcceleratorMonitor(interval_s=3600, nvml=ScriptedNvml([50] * 4, count=4))
    try:
        assert by_index.window()["accelerator_memory_used_bytes"] == 3 * 2**30
        assert by_uuid.window()["accelerator_memory_used_bytes"] == (2 + 4) * 2**30
        assert everything.window()["accelerator_memory_used_bytes"] == (1 + 2 + 3 + 4) * 2**30
    finally:
        for monitor in (by_index, by_uuid, everything):
            monitor.close()


def test_accelerator_monitor_of_a_gpu_nvml_does_not_have_says_nvml_error() -> None:
    monitor = AcceleratorMonitor(interval_s=3600, nvml=ScriptedNvml([50], count=1), devices=["5"])
    assert (monitor.available, monitor.reason, monitor.window()) == (False, "nvml_error", {})


@pytest.mark.parametrize(
    ("environ", "role", "local_rank", "devices"),
    [
        ({"CUDA_VISIBLE_DEVICES": "4,5"}, "rollout", 0, ["4", "5"]),  # an engine's TP slice
        ({}, "rollout", 1, None),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "trainer", 2, ["2"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, "actor", 1, ["GPU-b"]),
        ({}, "trainer", 3, ["3"]),  # cuda:LOCAL_RANK
        ({"CUDA_VISIBLE_DEVICES": "0"}, "trainer", 1, None),
    ],
)
def test_process_devices_narrow_nvml_to_the_process_gpus(environ, role, local_rank, devices):
    assert process_devices(environ, role=role, local_rank=local_rank) == devices


def test_phase_clock_windows_every_phase_and_resets() -> None:
    clock = PhaseClock()
    clock.add("train", 1.5)
    clock.add("train", 0.5)
    clock.add("wait", -1.0)  # a clock step backwards counts nothing
    with clock.timing("generate"):
        pass
    window = clock.window()
    assert set(window) == {f"phase_{p}_s" for p in PHASES}
    assert window["phase_train_s"] == 2.0
    assert window["phase_wait_s"] == 0.0
    assert 0.0 <= window["phase_generate_s"] < 1.0
    assert clock.window()["phase_train_s"] == 0.0
    with pytest.raises(ValueError, match="unknown phase"):
        clock.add("sleeping", 1.0)
