"""The CUDA GEMMs' measurement-only variants and the build flags' both sides
compile for sm_90a without register spills or local-memory arrays, and the
backward megakernel within its budget (compile only: no GPU needed, skipped
without nvcc).

`pip install` builds the default kernels only; the register-store-only build
(-DMOK_GEMM_TMA_STORE=0), the epilogue probe (-DMOK_GEMM_EPILOGUE_PROBE=1) and
the 3-stage ring with 5 TMA-store buffers per warp (-DMOK_GEMM_STAGES=3
-DMOK_GEMM_STG_BUFS=5) and the stage-wait probe (-DMOK_GEMM_WAIT_PROBE=1) are
built by the GPU scripts (tests/cuda/ab_tma_store.sh,
tests/cuda/gpu_session_stages.sh). The ping-pong kernels (forward GEMMs,
SwiGLU backward) are checked in their default builds too: pip's build
reports spills only in its log. Without this test a
change to the shared tile code could leave them broken, or spilling at the
168-register cap of the 384-thread CTA, until the next device session.
"""
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")


def compile_kernels(source, flags, tmp_path):
    """ptxas's per-kernel report {kernel name: (stack frame bytes, spill store bytes)}."""
    cmd = [NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           *flags, "-c", str(ROOT / "ffi" / source), "-I", str(ROOT / "ffi"),
           "-o", str(tmp_path / (source + ".o"))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}"
    spills, name = {}, None
    for line in r.stderr.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if m and name is not None:
            spills[name] = (int(m.group(1)), int(m.group(2)))
            name = None
    return spills


FORWARD = ("gemm_wgmma.cu", "grouped_gemm_kernel")
BACKWARD = ("gemm_wgmma_bwd.cu", "bwd_gemm_kernel")
PINGPONG = ("gemm_wgmma_bwd_pingpong.cu", "bwd_swiglu_pingpong_kernel")
FWD_PINGPONG = ("gemm_wgmma_pingpong.cu", "grouped_gemm_pingpong_kernel")
# Every variant flag with the sources it changes (the wait probe is in the
# forward GEMM only), and the ping-pong kernels' default builds (TMA-store
# epilogue only: none without it).
VARIANTS = [(flag, *src) for flag in ["-DMOK_GEMM_TMA_STORE=0", "-DMOK_GEMM_EPILOGUE_PROBE=1",
                                      "-DMOK_GEMM_STAGES=3 -DMOK_GEMM_STG_BUFS=5"]
            for src in (FORWARD, BACKWARD, PINGPONG, FWD_PINGPONG)] + \
    [("-DMOK_GEMM_WAIT_PROBE=1", *FORWARD), ("", *PINGPONG), ("", *FWD_PINGPONG)]
EXPECTED_KERNELS = {  # forward: 3 epilogues (plain, gate/up, activation only) x 2 cluster sizes;
    FORWARD[0]: lambda flag: 6,  # backward: 3 modes, x 2 with the TMA store
    BACKWARD[0]: lambda flag: 3 if flag == "-DMOK_GEMM_TMA_STORE=0" else 6,
    PINGPONG[0]: lambda flag: 0 if flag == "-DMOK_GEMM_TMA_STORE=0" else 1,
    # plain, gate/up keeping the pre-activation, gate/up activation only
    FWD_PINGPONG[0]: lambda flag: 0 if flag == "-DMOK_GEMM_TMA_STORE=0" else 3,
}


@pytest.mark.parametrize("flag,source,kernel", VARIANTS)
def test_variant_compiles_without_spills(flag, source, kernel, tmp_path):
    spills = compile_kernels(source, flag.split(), tmp_path)
    kernels = {k: v for k, v in spills.items() if kernel in k}
    assert len(kernels) == EXPECTED_KERNELS[source](flag), f"ptxas reported {sorted(spills)}"
    # No spills, and no accumulator array demoted to local memory (a loop over
    # acc[] left rolled shows as a stack frame, not as spills). The validated
    # default SwiGLU-backward kernel keeps 16 bytes on the stack.
    assert all(stack <= 16 and spill == 0 for stack, spill in kernels.values()), \
        f"{flag} {source}: (stack, spill) bytes {kernels}"


@pytest.mark.parametrize("inline,phased,task_smem", [(0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 0, 1)])
def test_backward_megakernel_register_budget(inline, phased, task_smem, tmp_path):
    """The persistent backward megakernel (megakernel_bwd.cu), both builds of
    its consume task: inlined (measured faster) within a small spill budget
    when the task is copied to registers (TASK_IN_SMEM=0: 152 bytes today),
    not inlined with no spills anywhere; the staged-order ticket decode
    (MOK_BWD_MEGAKERNEL_PHASED, measurement); and the default, inlined with
    the task read from its shared slot (MOK_BWD_MEGAKERNEL_TASK_IN_SMEM=1),
    which must not spill at all (that is why it is the default)."""
    spills = compile_kernels("megakernel_bwd.cu", [f"-DMOK_BWD_MEGAKERNEL_INLINE={inline}",
                                                   f"-DMOK_BWD_MEGAKERNEL_PHASED={phased}",
                                                   f"-DMOK_BWD_MEGAKERNEL_TASK_IN_SMEM={task_smem}"],
                             tmp_path)
    kernels = {k: v for k, v in spills.items() if "moe_backward_megakernel" in k}
    assert len(kernels) == 1, f"ptxas reported {sorted(spills)}"
    if task_smem:
        assert all(v == (0, 0) for v in spills.values()), spills
    elif inline:
        (stack, spill), = kernels.values()
        assert stack <= 128 and spill <= 256, f"(stack, spill) bytes {kernels}"
    else:
        # the kernel, the three consume tasks and the ticket decoder
        assert len(spills) >= 4 and all(v == (0, 0) for v in spills.values()), spills
