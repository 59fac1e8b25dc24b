import json
import re
import subprocess
import sys

import pytest

from autotp.cli import main


def _autotp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autotp", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_run_trains_and_matches_the_unparallelized_loss() -> None:
    result = _autotp("run", "--tp", "2", "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^step 1  loss \d+\.\d{4}  lr \S+  \S+ tokens/s  MFU \S+%$", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^step 2  loss \d+\.\d{4}  lr \S+  \S+ tokens/s  MFU \S+%$", result.stdout, re.MULTILINE), result.stdout
    diff = re.search(r"step-1 loss vs the unparallelized model on the same batch and weights: .* \(\|diff\| (\S+)\)", result.stdout)
    assert diff is not None, result.stdout
    assert float(diff.group(1)) < 1e-4
    assert re.search(r"all-reduces per rank graph: \d+ forward, \d+ backward", result.stdout)


def test_unknown_model_exits_2_with_one_line() -> None:
    result = _autotp("run", "--model", "no-such-model")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "unknown model 'no-such-model'" in lines[0] and "llama-tiny" in lines[0]


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "run" in capsys.readouterr().out


def test_ranks_and_schedule_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ranks", "--world-size", "16", "--tp", "4", "--pp", "2", "--format", "json"]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert groups["pp"][0] == [0, 8] and groups["dp"][0] == [0, 4]
    assert main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--rank", "0"]) == 0
    assert capsys.readouterr().out.split()[:11] == "1 1 1 1 2 2 2 2 1 1 1".split()
    assert main(["schedule", "--pp", "4", "--microbatches", "2", "--rank", "0"]) == 2
    assert "1F1B needs at least as many microbatches" in capsys.readouterr().err


def _config_folder(folder, weights: str | None):
    """A folder with a tiny Llama's config.json and, by ``weights``, its weights as
    ``pytorch_model.bin`` (a format autotp does not read) or none."""
    import torch
    from autotp import presets

    model = presets.build_model("llama-tiny", device="cpu")
    model.config.save_pretrained(folder)
    if weights == "bin":
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("weights", ["bin", None])
def test_run_refuses_a_folder_without_safetensors(tmp_path, weights, capsys: pytest.CaptureFixture[str]) -> None:
    # It trained randomly initialized weights without a word: the trained ones were ignored.
    folder = _config_folder(tmp_path / "model", weights)
    assert main(["run", "--model", str(folder), "--tp", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(folder) in err and "safetensors" in err and "--random-init" in err
    if weights == "bin":
        assert "pytorch_model.bin" in err


def test_run_random_init_says_so(tmp_path) -> None:
    folder = _config_folder(tmp_path / "model", None)
    result = _autotp("run", "--model", str(folder), "--tp", "1", "--steps", "1", "--random-init")
    assert result.returncode == 0, result.stderr
    assert "from random weights" in result.stderr
    assert re.search(r"^step 1  loss \d+\.\d{4}  lr \S+  \S+ tokens/s  MFU \S+%$", result.stdout, re.MULTILINE), result.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
        (["check", "llama-tiny", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
        (["convert", "src", "dst", "--tp", "0"], "--tp must be at least 1, got 0"),
        (["convert", "src", "dst", "--timeout", "-1"], "--timeout must be a positive number of seconds, got -1"),
    ],
)
def test_degrees_and_timeouts_are_checked_by_name(argv, message, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
