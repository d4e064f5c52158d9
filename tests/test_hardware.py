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
    print(hardware.cap_gpu_memory(budget))
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(int((budget + 0.5) * hardware.GIB), dtype=torch.uint8, device="cuda")
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), ("12GB", TypeError), (True, TypeError)])
def test_cap_gpu_memory_bad_input(bad, error):
    with pytest.raises(error, match="budget"):
        hardware.cap_gpu_memory(bad)


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


def test_total_memory_is_positive():
    assert hardware.total_memory_bytes() > 2**30
