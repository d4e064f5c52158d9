"""course_utils.hardware: device, profile, bf16 rule, GPU cap, banner."""
import pytest
import torch

from course_utils import hardware


def test_device_type_matches_torch():
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert hardware.device_type() == expected
    assert hardware.get_device().type == expected


def test_profile_default_and_override(monkeypatch):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    assert hardware.course_profile() == ("full" if torch.cuda.is_available() else "smoke")
    monkeypatch.setenv("COURSE_PROFILE", "full")
    assert hardware.course_profile() == "full"
    monkeypatch.setenv("COURSE_PROFILE", " Smoke ")
    assert hardware.course_profile() == "smoke"


def test_unknown_profile_says_what_to_set(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "huge")
    with pytest.raises(ValueError, match="smoke"):
        hardware.course_profile()


@pytest.mark.parametrize("cc, expected", [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_bf16_only_from_compute_capability_8(monkeypatch, cc, expected):
    # A T4 (7.5) says torch.cuda.is_bf16_supported() == True through emulation; the course says no.
    monkeypatch.setattr(hardware, "compute_capability", lambda: cc)
    assert hardware.supports_bf16() is expected


def test_bf16_false_without_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "compute_capability", lambda: None)
    assert hardware.supports_bf16() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_cap_gpu_memory_says_it_does_nothing_on_cpu():
    message = hardware.cap_gpu_memory(12)
    assert "does nothing" in message and "12" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cap_gpu_memory_caps_a_large_gpu():
    total_gib = torch.cuda.get_device_properties(0).total_memory / hardware.GIB
    budget = min(2.0, total_gib / 2)
    message = hardware.cap_gpu_memory(budget)
    assert "left for the CUDA context (measured)" in message
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(int((budget + 0.5) * hardware.GIB), dtype=torch.uint8, device="cuda")
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), ("12GB", TypeError), (True, TypeError)])
def test_cap_gpu_memory_bad_input(bad, error):
    with pytest.raises(error, match="budget"):
        hardware.cap_gpu_memory(bad)


def test_allocator_fraction_leaves_room_for_the_context():
    total, context = 80 * hardware.GIB, 512 * hardware.MIB
    fraction = hardware.allocator_fraction(total, 12 * hardware.GIB, context)
    assert fraction * total + context == 12 * hardware.GIB
    assert hardware.allocator_fraction(8 * hardware.GIB, 12 * hardware.GIB, context) == 1.0  # a small card: no cap
    with pytest.raises(ValueError, match="leaves nothing for tensors"):
        hardware.allocator_fraction(total, 256 * hardware.MIB, context)
    with pytest.raises(ValueError, match="context_bytes"):
        hardware.allocator_fraction(total, 12 * hardware.GIB, -1)
    with pytest.raises(ValueError, match="total_bytes is 0"):
        hardware.allocator_fraction(0, 12 * hardware.GIB, context)


def test_cuda_context_from_counters_and_a_pretend_card(monkeypatch):
    gib = hardware.GIB
    assert hardware.cuda_context_from_counters(70 * gib, 80 * gib, 9 * gib) == 1 * gib
    assert hardware.cuda_context_from_counters(75 * gib, 80 * gib, 6 * gib) == 0  # never below 0
    with pytest.raises(ValueError, match="exceeds"):
        hardware.cuda_context_from_counters(90 * gib, 80 * gib, 0)
    with pytest.raises(ValueError, match="reserved"):
        hardware.cuda_context_from_counters(1, 2, -3)

    if not torch.cuda.is_available():
        assert hardware.cuda_context_bytes() is None
    # what a card with 300 MiB of context and 2 GiB reserved reports
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (16 * gib - 2 * gib - 300 * hardware.MIB, 16 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 2 * gib)
    assert hardware.cuda_context_bytes() == 300 * hardware.MIB


def test_cap_gpu_memory_cuda_branch_with_a_pretend_card(monkeypatch):
    fractions = []

    class Props:
        total_memory = 80 * hardware.GIB

    monkeypatch.setattr(hardware.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware.torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(hardware.torch.cuda, "set_per_process_memory_fraction", lambda f, i: fractions.append(f))
    monkeypatch.setattr(hardware, "gpu_name", lambda: "Pretend GPU")
    monkeypatch.setattr(hardware, "cuda_context_bytes", lambda: 400 * hardware.MIB)
    message = hardware.cap_gpu_memory(12)
    assert fractions == [pytest.approx((12 * hardware.GIB - 400 * hardware.MIB) / (80 * hardware.GIB))]
    assert "0.39 GiB left for the CUDA context (measured)" in message and "11.61 GiB" in message
    monkeypatch.setattr(hardware, "cuda_context_bytes", lambda: None)
    assert "0.50 GiB left for the CUDA context (assumed)" in hardware.cap_gpu_memory(12)
    assert "no cap needed" in hardware.cap_gpu_memory(100) and len(fractions) == 2


def test_gpu_bytes_needed_adds_reserve_and_context():
    tensors = 10 * hardware.GIB
    expected = tensors + round(hardware.ALLOCATOR_RESERVE_FRACTION * tensors) + hardware.CUDA_CONTEXT_BYTES
    assert hardware.gpu_bytes_needed(tensors) == expected
    assert hardware.gpu_bytes_needed(0) == hardware.CUDA_CONTEXT_BYTES
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_peak_bytes"):
            hardware.gpu_bytes_needed(bad)


def test_banner_has_device_memory_profile_versions(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "smoke")
    line = hardware.banner()
    assert "\n" not in line
    for part in ("device=", "GiB", "profile=smoke", "torch", "python"):
        assert part in line


def test_colab_detection(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert hardware.in_colab() is False
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261101")
    assert hardware.in_colab() is True


def test_report_names_the_memory():
    gib = float(hardware.hardware_report().split("memory ")[1].split(" GiB")[0])
    assert gib > 1
