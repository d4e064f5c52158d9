"""course_utils.hardware: device, profile, bf16 rule, GPU cap, cuBLAS workspaces, banner."""
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
    monkeypatch.setenv("COURSE_PROFILE", "gpu-check")   # scripts/gpu_check.sh's sizes
    assert hardware.course_profile() == "gpu-check"


def test_unknown_profile_says_what_to_set(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "huge")
    with pytest.raises(ValueError, match="'huge' is not a profile; set it to one of smoke, gpu-check, full"):
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
    with hardware.gpu_memory_cap(budget) as message:
        assert "left for the CUDA context (measured)" in message
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int((budget + 0.5) * hardware.GIB), dtype=torch.uint8, device="cuda")
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0  # the cap is lifted after the block


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), ("12GB", TypeError), (True, TypeError)])
def test_cap_gpu_memory_bad_input(bad, error):
    with pytest.raises(error, match="budget"):
        hardware.cap_gpu_memory(bad)


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


KERNELS_LOADED = []  # the devices load_training_kernels was called for, under pretend_card


@pytest.fixture
def pretend_card(monkeypatch):
    """An 80 GiB CUDA card on a CPU: the calls to set_per_process_memory_fraction are recorded."""
    calls = []

    class Props:
        total_memory = 80 * hardware.GIB

    monkeypatch.setattr(hardware.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware.torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(hardware.torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append((f, device)))
    monkeypatch.setattr(hardware, "gpu_name", lambda: "Pretend GPU")
    monkeypatch.setattr(hardware, "cuda_context_bytes", lambda: 400 * hardware.MIB)
    KERNELS_LOADED.clear()
    monkeypatch.setattr(hardware, "load_training_kernels", KERNELS_LOADED.append)
    return calls


def test_cap_gpu_memory_cuda_branch_with_a_pretend_card(pretend_card, monkeypatch):
    message = hardware.cap_gpu_memory(12)
    (fraction, device), = pretend_card
    assert KERNELS_LOADED == ["cuda"], "the context is measured once a training step's kernels are loaded"
    assert fraction * 80 * hardware.GIB + 400 * hardware.MIB == pytest.approx(12 * hardware.GIB)  # allocator + context
    assert device == 0  # torch refuses torch.device("cuda") without an index
    assert "0.39 GiB left for the CUDA context (measured, a training step's kernels loaded)" in message and "11.61 GiB" in message
    with pytest.raises(ValueError, match="leaves nothing for tensors"):
        hardware.cap_gpu_memory(0.25)
    monkeypatch.setattr(hardware, "cuda_context_bytes", lambda: None)
    assert "0.50 GiB left for the CUDA context (assumed" in hardware.cap_gpu_memory(12)
    assert "no cap needed" in hardware.cap_gpu_memory(100) and len(pretend_card) == 2


def test_gpu_memory_cap_lifts_the_cap_even_when_the_block_raises(pretend_card):
    with hardware.gpu_memory_cap(2) as message:
        assert "Capped Pretend GPU" in message and len(pretend_card) == 1
    with pytest.raises(RuntimeError, match="out of memory"):
        with hardware.gpu_memory_cap(2):
            raise RuntimeError("CUDA out of memory")
    capped = (pytest.approx((2 * hardware.GIB - 400 * hardware.MIB) / (80 * hardware.GIB)), 0)
    assert pretend_card == [capped, (1.0, 0)] * 2  # capped, then lifted, each time on device 0
    assert all(type(f) is float for f, _ in pretend_card)  # torch refuses a fraction that is not a float


@pytest.mark.parametrize("cc, per_handle", [((7, 5), 8 * hardware.MIB + 128 * hardware.KIB), ((8, 0), 8_519_680),
                                            ((8, 9), 8_519_680), ((9, 0), 32 * hardware.MIB),
                                            ((10, 0), 32 * hardware.MIB), ((12, 0), 32 * hardware.MIB),
                                            ((13, 0), 8_519_680)])
def test_cublas_workspaces_per_compute_capability(monkeypatch, cc, per_handle):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", raising=False)
    assert hardware.cublas_workspace_bytes(cc, handles=1) == per_handle
    assert hardware.cublas_workspace_bytes(cc) == 2 * per_handle  # the loop's thread and autograd's backward thread
    assert hardware.cublas_workspace_bytes(cc, handles=0) == 0


def test_cublaslt_keeps_a_workspace_of_its_own_only_when_told_not_to_share(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", raising=False)
    shared = hardware.cublas_workspace_bytes((9, 0), handles=1)
    assert shared == 32 * hardware.MIB   # PyTorch's builds: cuBLASLt uses cuBLAS's workspace
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0")
    assert hardware.cublas_workspace_bytes((9, 0), handles=1) == shared + hardware.MIB   # its own 1 MiB by default
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")
    assert hardware.cublas_workspace_bytes((9, 0)) == 2 * (shared + 4 * hardware.MIB)


def test_cublas_workspaces_follow_the_environment_and_default_to_the_larger(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the small deterministic setting
    assert hardware.cublas_workspace_bytes((9, 0), handles=1) == 128 * hardware.KIB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "not a config")  # PyTorch warns and keeps its default
    assert hardware.cublas_workspace_bytes((8, 6), handles=1) == 8_519_680
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hardware.cublas_workspace_bytes() == hardware.cublas_workspace_bytes((9, 0))  # no GPU: the larger one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))  # a T4
    assert hardware.cublas_workspace_bytes() == hardware.cublas_workspace_bytes((7, 5))


def test_cublas_workspaces_bad_input():
    for bad in ((8,), "9.0", 9.0, (9, "0")):
        with pytest.raises(ValueError, match="compute_capability"):
            hardware.cublas_workspace_bytes(bad)
    with pytest.raises(TypeError, match="handles"):
        hardware.cublas_workspace_bytes((8, 0), handles=1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cublas_workspace_is_the_one_torch_uses():
    if hasattr(torch.backends.cuda, "cublas_workspace_size"):  # torch >= 2.14
        assert hardware.cublas_workspace_bytes(handles=1) == torch.backends.cuda.cublas_workspace_size()


def test_gpu_bytes_needed_adds_reserve_workspaces_and_context():
    tensors = 10 * hardware.GIB
    for cc in ((7, 5), (9, 0)):
        expected = (tensors + round(hardware.ALLOCATOR_RESERVE_FRACTION * tensors) + hardware.cublas_workspace_bytes(cc)
                    + hardware.CUDA_CONTEXT_BYTES)
        assert hardware.gpu_bytes_needed(tensors, cc) == expected
    assert hardware.gpu_bytes_needed(tensors, (9, 0)) - hardware.gpu_bytes_needed(tensors, (8, 0)) == 2 * (32 * hardware.MIB - 8_519_680)
    assert hardware.gpu_bytes_needed(0) == hardware.CUDA_CONTEXT_BYTES + hardware.cublas_workspace_bytes()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_peak_bytes"):
            hardware.gpu_bytes_needed(bad)
    with pytest.raises(ValueError, match="compute_capability"):
        hardware.gpu_bytes_needed(tensors, "8.6")


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


def test_pcie_seconds_is_the_one_copy_time():
    """One formula: a link's rate times the pinned-copy efficiency, or a measured rate; the table is the same call."""
    link_rate = hardware.PCIE_GB_PER_S["PCIe 4.0 x16"] * hardware.PCIE_EFFICIENCY
    assert hardware.pcie_seconds(10**9, "PCIe 4.0 x16") == pytest.approx(1 / link_rate)
    assert hardware.pcie_seconds(16 * 10**9, gb_per_s=16.0) == pytest.approx(1.0)
    assert hardware.pcie_seconds(0) == 0.0
    table = hardware.pcie_table(4 * 10**9)
    assert list(table.index) == list(hardware.PCIE_GB_PER_S)
    assert table.loc["PCIe 3.0 x16", "seconds"] == hardware.pcie_seconds(4 * 10**9, "PCIe 3.0 x16")
    assert table["seconds"].is_monotonic_decreasing  # each generation doubles the rate


def test_pcie_seconds_says_what_to_change():
    with pytest.raises(ValueError, match="PCIe 3.0 x16"):
        hardware.pcie_seconds(10**9, "PCIe 9.0 x1")
    with pytest.raises(ValueError, match="GB/s"):
        hardware.pcie_seconds(10**9, gb_per_s=0)
    with pytest.raises((ValueError, TypeError)):
        hardware.pcie_seconds(-1)


def test_the_training_kernels_load_on_any_device():
    """The warm-up the cap runs before it measures the CUDA context, on its CPU twin: every kind of kernel it names."""
    hardware.load_training_kernels("cpu")
