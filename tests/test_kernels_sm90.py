"""Every Triton kernel compiles for an H100/H200 (sm_90) without a GPU, and none spills registers.

The interpreter tests check the kernels' arithmetic, not the GPU compiler:
``benchmarks/compile_sm90.py`` builds each variant the launchers make with
Triton's compiler and the bundled ptxas, and nothing runs.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sigmafast.kernels import support, triton_problem

pytestmark = pytest.mark.skipif(triton_problem() is not None, reason=f"the kernels cannot run here: {triton_problem()}")
SPILL_FREE_TRITON = (3, 9)  # 3.4 to 3.8 spill a few variants (at most 456 bytes of stack; 3.6: float32 ones only)


def _spills_checked() -> bool:
    """Whether this triton's compiler is one the kernels are tuned for (no spills), not an older one."""
    version = support.installed_triton()[1]
    return version is None or version >= SPILL_FREE_TRITON


ROOT = Path(__file__).resolve().parents[1]
KERNELS = {
    "_cascade_attn_kernel", "_combine_kernel", "_chunk_stats_kernel", "_sample_kernel", "_residual_mass_kernel",
    "_residual_kernel", "_logq_finish_kernel", "_draft_argmax_kernel", "_radix_hist_kernel", "_radix_select_kernel",
    "_chunk_max_kernel", "_pivot_kernel", "_collect_kernel", "_cand_select_kernel", "_topk_logq_kernel",
    "_lm_head_stream_kernel", "_lm_head_finish_kernel", "_commit_kv_kernel", "_commit_state_kernel",
    "_add_layer_norm_kernel", "_linear_gelu_kernel", "_linear_add_norm_kernel", "_mlp_add_norm_kernel",
    "_decide_kernel", "_feed_embedding_kernel", "_flag_nonfinite_kernel",
    "_gather_drafts_kernel", "_draft_slots_kernel", "_rotary_kernel",
    "_residual_pick_kernel", "_plan_step_kernel", "_residual_rows_kernel",
}


def _ptxas() -> Path:
    triton = pytest.importorskip("triton")
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _compile_report(tmp_path_factory, *flags: str) -> dict:
    if not _ptxas().exists():
        pytest.skip("triton has no bundled NVIDIA ptxas here: cannot compile for sm_90")
    out = tmp_path_factory.mktemp("sm90") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)  # this checkout's kernels
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_sm90.py"), *flags,
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=1200)
    if not out.exists():
        pytest.fail(f"compile_sm90.py wrote no report (rc {done.returncode}):\n"
                    f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _problems(rep: dict, dtypes: tuple, gdc: bool) -> list:
    """What is wrong with a compile_sm90 report: failed compilations, kernels missing per dtype, spills, and
    variants whose PTX does (plain) or does not (``gdc``) wait for the previous kernel."""
    out = [f"does not compile: {e['dtype']} {e['case']}: {e['error']}" for e in rep["errors"]]
    for dtype in dtypes:
        built = {r["kernel"] for r in rep["rows"] if r["dtype"] == dtype}
        if built != KERNELS:
            out.append(f"{dtype}: missing {sorted(KERNELS - built)}, unexpected {sorted(built - KERNELS)}")
    for r in rep["rows"]:
        if (r["local"] or r["stack"]) and _spills_checked():
            out.append(f"spills: {r['dtype']} {r['kernel']} ({r['case']}): {r['stack']} bytes of stack, "
                       f"{r['local']} of local memory")
        if r["gdc"] != gdc:
            out.append(f"{'no' if gdc else 'a'} griddepcontrol.wait: {r['dtype']} {r['kernel']} ({r['case']})")
    return out


def test_every_kernel_compiles_for_sm90_without_spills(tmp_path_factory):
    """Every variant the launchers make, bf16 and fp32: compiles, takes no stack or local memory (with the
    compilers of Triton 3.9 and later), and never waits on ``griddepcontrol`` (plain launches)."""
    problems = _problems(_compile_report(tmp_path_factory, "--dtypes", "bf16,fp32"), ("bf16", "fp32"), gdc=False)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not support.triton_has_pdl(), reason="programmatic dependent launch needs triton >= 3.5")
def test_programmatic_dependent_launch_variants_compile_and_wait(tmp_path_factory):
    """The variants launched inside ``kernels.use_pdl(True)``: a kernel may start before the previous one ends, so
    every one must wait for it (``utils.gdc_enter``, PTX ``griddepcontrol.wait``) before it reads or writes;
    they compile for sm_90 without spills too."""
    problems = _problems(_compile_report(tmp_path_factory, "--dtypes", "bf16", "--pdl"), ("bf16",), gdc=True)
    assert not problems, "\n".join(problems)


def test_every_kernel_waits_before_its_first_statement():
    """``gdc_enter(USE_GDC)`` is the first statement of every Triton kernel (after its docstring): under
    programmatic dependent launch nothing before it may read or write memory (the PTX check above only sees
    that the wait is there)."""
    found, late = set(), []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") \
                    and any(ast.unparse(d).startswith(("triton.jit", "jit(")) for d in node.decorator_list):
                found.add(node.name)
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                if ast.unparse(body[0]) != "gdc_enter(USE_GDC)":
                    late.append(f"{path.name}: {node.name} starts with {ast.unparse(body[0])!r}")
    assert found == KERNELS, f"missing {sorted(KERNELS - found)}, unexpected {sorted(found - KERNELS)}"
    assert not late, "\n".join(late)


def test_the_tests_launches_compile_for_sm90():
    """``benchmarks/compile_tested.py`` replays through the sm_90 compiler every launch the embedding, LayerNorm
    and sublayer-end tests make in the interpreter: narrow rows included, where the interpreter runs a
    ``tl.dot`` narrower than the 16 columns the compiler requires."""
    if not _ptxas().exists():
        pytest.skip("triton has no bundled NVIDIA ptxas here: cannot compile for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_tested.py"),
                           "tests/test_kernels_embed.py", "tests/test_kernels_linear_norm.py",
                           "tests/test_kernels_layer_norm.py"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    summary = [line for line in done.stdout.splitlines() if line.startswith(("triton", "FAILED", "STACK"))]
    assert done.returncode == 0, "\n".join(summary) or done.stdout[-3000:] + done.stderr[-3000:]
    want = " 0 failed to compile, 0 variants with a stack frame" if _spills_checked() else " 0 failed to compile"
    assert want in summary[0], "\n".join(summary)
