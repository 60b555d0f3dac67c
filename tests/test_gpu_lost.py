"""findings/gpu_lost.py on its own: typed readings (a recorded H200 uevent as sources/udev.py
reports it, an NVML lost GPU) -> the one gpu_lost finding of the node, through the full rule list
as the join runs it."""

from __future__ import annotations

import time
from pathlib import Path

from gpuwatchd.config.schema import Config
from gpuwatchd.findings import FindingContext, evaluate, gpu_lost
from gpuwatchd.model import GpuDevice
from gpuwatchd.model.parts import GpuOutput, GpuRemoved, NvmlLostGpu, Tracked
from gpuwatchd.sources.udev import classify, parse_uevent_file

FIX = Path(__file__).parent / "fixtures" / "nvml"
UUID = "GPU-d6a79800-1da5-699b-0f9c-f55eb218f8b2"


def _removed(action: str, t: float, index: str = "0", uuid: str = UUID) -> GpuRemoved:
    ev = classify(action, parse_uevent_file((FIX / "h200_pci_uevent.txt").read_text()), t)
    assert ev is not None and ev.lost
    return GpuRemoved(ev, index, uuid)


def test_no_reading_no_finding() -> None:
    assert list(gpu_lost.find(FindingContext(now=0.0, config=Config()))) == []


def test_a_udev_removal_and_an_nvml_lost_gpu_are_one_page() -> None:
    known = GpuDevice(1, "GPU-b", "H200", "00000000:07:00.0", None, None, None)
    ctx = FindingContext(
        now=2000.0,
        config=Config(),
        parts=Tracked(
            gpu=GpuOutput(
                gpus_removed=(_removed("remove", 1234.0),),
                gpus_lost=(NvmlLostGpu(1, known, 1990.0), NvmlLostGpu(2, None, 1990.0)),
            )
        ),
    )
    (f,) = [f for f in evaluate(ctx) if f.kind == "gpu_lost"]
    at = time.strftime("%H:%M:%S", time.localtime(1234.0))
    assert f.severity == "page" and f.since == 1234.0 and (f.job_id, f.rank, f.pid) == ("", "", "")
    assert f.explanation == (
        f"GPU 0 ({UUID}, PCI 0000:00:06.0) disappeared from the PCI bus (remove uevent at {at}); "
        "processes on it will fail; check 'dmesg' for Xid 79 and the node's hardware; "
        "GPU 1 (GPU-b, PCI 00000000:07:00.0): NVML reports the GPU is lost (NVML_ERROR_GPU_IS_LOST);"
        " its processes will fail; check 'dmesg' for Xid 79 and the node's hardware; "
        "GPU 2: NVML reports the GPU is lost (NVML_ERROR_GPU_IS_LOST); its processes will fail; "
        "check 'dmesg' for Xid 79 and the node's hardware"
    )
    assert f.evidence == {
        "gpus": [
            {"pci_bus_id": "0000:00:06.0", "action": "remove", "gpu": "0", "uuid": UUID},
            {"gpu": "1", "uuid": "GPU-b", "source": "nvml"},
            {"gpu": "2", "uuid": "", "source": "nvml"},
        ]
    }


def test_a_removal_nvml_never_knew_is_named_by_its_address() -> None:
    (f,) = gpu_lost.find(
        FindingContext(
            now=0.0, config=Config(), parts=Tracked(gpu=GpuOutput(gpus_removed=(_removed("unbind", 5.0, "", ""),)))
        )
    )
    assert f.explanation.startswith("GPU at PCI 0000:00:06.0 disappeared from the PCI bus (unbind")
