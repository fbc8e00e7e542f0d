"""scripts/sample.py: infill templates, the live view, and its flags' errors, each in one line."""

from __future__ import annotations

import pytest
import torch
from helpers import sample_script

from sigmafast.tasks import get_task


def test_sample_script_parses_infill_templates():
    script = sample_script()
    step = get_task("step", seq_len=6, run_length=2)
    tokens, known = script.parse_template("01__1", step, 6)
    assert tokens.tolist() == [0, 1, 0, 0, 1, 0] and known.tolist() == [True, True, False, False, True, False]
    tokens, known = script.parse_template("3 _ 4", get_task("permutation", seq_len=6), 6)
    assert tokens[:3].tolist() == [3, 0, 4] and known.tolist() == [True, False, True, False, False, False]
    tokens, known = script.parse_template("5", get_task("permutation", seq_len=12), 12)  # ids up to 11: one id
    assert tokens[:2].tolist() == [5, 0] and known[:2].tolist() == [True, False]
    tokens, known = script.parse_template("11", get_task("permutation", seq_len=12), 12)
    assert tokens[:2].tolist() == [11, 0] and known[:2].tolist() == [True, False]
    with pytest.raises(ValueError, match="template"):
        script.parse_template("0 x", step, 6)
    for item in (str(step.bos), str(step.vocab_size)):  # BOS (2 here) and past the vocabulary are not data
        with pytest.raises(ValueError, match=r"data tokens: in \[0, 3\) but not BOS \(2\)"):
            script.parse_template(f"01_{item}", step, 6)
    with pytest.raises(ValueError, match="canvas length"):
        script.parse_template("0101010", step, 6)
    dna = get_task("char", text="unread.txt", seq_len=8, chars="\nACGT")  # a text task without an 'a'
    tokens, known = script.parse_template("AC__T", dna, 8)
    assert known.tolist() == [True, True, False, False, True, False, False, False]
    assert dna.decode(tokens[[0, 1, 4]].tolist()) == "ACT"


@pytest.mark.parametrize("item", ["\u00b2", "\u2460", "\u00b9\u00b2"])
def test_sample_script_names_the_template_for_digits_that_are_not_decimal(item):
    """str.isdigit() holds for superscripts and circled digits, which int() refuses: the template's own error."""
    with pytest.raises(ValueError, match="infill template items must be token ids or '_'"):
        sample_script().parse_template(f"3 _ {item}", get_task("permutation", seq_len=6), 6)


def test_sample_script_renders_a_partial_maze():
    """The live view of a fixed-layout task decodes the whole canvas, its unknown cells as '?'."""
    script = sample_script()
    maze = get_task("maze", height=5, width=5, n_walls=0, min_distance=2, val_size=8)
    row = maze.sample_batch(1, "val", torch.Generator().manual_seed(0))[0]
    known = torch.arange(maze.seq_len) % 3 != 0
    shown = script.render(maze, row, known)
    assert shown.count("?") == int((~known).sum())
    assert script.render(maze, row, torch.ones_like(known)) == maze.decode(row)


def test_sample_script_refuses_a_partial_maze_before_sampling(monkeypatch):
    """A fixed layout decodes only whole: --max-new-tokens short of it is an error before any sampling."""
    script = sample_script()
    maze = get_task("maze", height=5, width=5, n_walls=0, min_distance=2, val_size=8)
    monkeypatch.setattr("sigmafast.train.load_checkpoint", lambda *a, **k: (maze.oracle, maze, None))
    monkeypatch.setattr(script.sigmafast, "generate", lambda *a, **k: pytest.fail("sampled"))
    with pytest.raises(ValueError, match=f"fixed layout of {maze.seq_len} tokens: --max-new-tokens must be"):
        script.run(script.SampleArgs(checkpoint="maze.pt", max_new_tokens=10))


@pytest.mark.parametrize("argv,match", [
    pytest.param(["--infill", "0 _ 1", "--length", "0"], "--length must be >= 1, got 0", id="length-0"),
    pytest.param(["--infill", "0 _ 1", "--length", "-3"], "--length must be >= 1, got -3", id="length-negative"),
    pytest.param(["--length", "5"], "--length is the canvas length of --infill", id="length-without-infill"),
    pytest.param(["--device", "gpu"], "device must be a torch device", id="bad-device"),
    pytest.param(["--infill", "0 _ 1", "--max-new-tokens", "3"], "--max-new-tokens is for --prompt and "
                 "unconditional sampling", id="max-new-tokens-with-infill"),
    pytest.param(["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0, got -1", id="max-new-tokens-negative"),
    pytest.param(["--seed", str(10**23)], f"--seed must be in [0, 2**63), got {10**23}", id="seed-huge"),
    pytest.param(["--seed", "-2"], "--seed must be in [0, 2**63), got -2", id="seed-negative"),
    pytest.param(["--device", "cuda"], "CUDA is not available", id="cuda-without-cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")),
])
def test_sample_script_bad_input(argv, match, tmp_path, capsys):
    """Rejected in one line before the checkpoint is even read."""
    code = sample_script().main(["--checkpoint", str(tmp_path / "never-read.pt"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert match in err


def test_sample_script_checkpoint_errors_name_its_flags(trained_dir, tmp_path, capsys):
    """A folder, a missing file or a prompt longer than the model: one line naming sample.py's own flags."""
    from sigmafast.train import TrainConfig, train

    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 40)
    train(TrainConfig(task="char", text=str(text), seq_len=8, max_iters=1, batch_size=4, eval_iters=1,
                      num_eval_samples=0, out_dir=str(tmp_path / "char")))
    cases = [
        (["--checkpoint", str(trained_dir)], f"no checkpoint at {trained_dir}: it is a directory: pass the "
                                              f"checkpoint file, {trained_dir / 'ckpt.pt'}"),
        (["--checkpoint", str(tmp_path / "none.pt")], f"no checkpoint at {tmp_path / 'none.pt'}"),
        (["--checkpoint", str(tmp_path / "char" / "ckpt.pt"), "--prompt", "the cat sat"],
         "--prompt is 11 tokens long, longer than the model's sequence length (8 tokens)"),
    ]
    for argv, message in cases:
        assert sample_script().main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"error: {message}\n" or err.startswith(f"error: {message}:"), err
        assert "--resume" not in err and "--out-dir" not in err
    huge = ["--checkpoint", str(trained_dir / "ckpt.pt"), "--num-samples", str(10**12)]
    for argv in (huge, [*huge, "--strategy", "autoregressive"], [*huge, "--infill", "3 _ 4"]):
        assert sample_script().main(argv) == 2  # the batch is an expanded view: refused before the canvas exists
        err = capsys.readouterr().err
        assert err.startswith(f"error: a canvas of {10**12} rows of ") and err.endswith("reduce --num-samples\n"), err
    assert sample_script().main(["--checkpoint", str(tmp_path / "char" / "ckpt.pt"), "--prompt", "the cat "]) == 0


def test_sample_script_defaults_to_exact_sampling():
    args = sample_script().SampleArgs(checkpoint="ckpt.pt")
    assert (args.strategy, args.acceptance, args.num_orders) == ("burst", "lossless", 1)
    assert sample_script().SampleArgs(checkpoint="ckpt.pt", acceptance="paper").num_orders == 5


def test_sample_script_stops_quietly_when_its_reader_leaves(trained_dir):
    """``sample.py ... | head``: once the reader has gone, the writes fail with EPIPE; the script stops with
    exit status 1 and no traceback. 3000 rows print far more than a pipe buffers, so the reader always leaves
    with writes still to come."""
    import subprocess
    import sys

    from helpers import REPO

    script = REPO / "scripts" / "sample.py"
    with subprocess.Popen([sys.executable, str(script), "--checkpoint", str(trained_dir / "ckpt.pt"),
                           "--num-samples", "3000", "--strategy", "autoregressive"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        proc.stdout.read(1)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=300)
    assert code == 1 and err == "", err


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--num-orders", "3"], "--acceptance lossless uses a single order chosen before drafting: pass "
                 "--num-orders 1 (got 3)", id="lossless-orders"),
    pytest.param(["--top-k", "0"], "--top-k must be >= 1, got 0", id="top-k-0"),
    pytest.param(["--strategy", "autoregressive", "--acceptance", "paper"], "--acceptance and --num-orders apply to "
                 "--strategy burst only", id="ar-paper"),
    pytest.param(["--order", "left-to-right"], "--strategy burst always verifies random orders; --order "
                 "left-to-right needs", id="burst-left-to-right"),
    pytest.param(["--max-new-tokens", "13"], "(prompt 0 + --max-new-tokens 13) exceeds", id="too-long"),
])
def test_sample_script_names_its_flags_in_the_sampler_s_errors(trained_dir, capsys, argv, message):
    """generate's argument names, as the flags that set them."""
    assert sample_script().main(["--checkpoint", str(trained_dir / "ckpt.pt"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
