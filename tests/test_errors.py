"""A user's mistakes give a clear error, never a silent wrong number (issue 16)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autotp
from autotp.cli import main
from autotp.ir import ops
from autotp.ir.errors import UserInputError
from autotp.presets import build_model
from autotp.runtime.processes.launcher import RankError, spawn_ranks
from distributed import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def test_help_loads_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); from autotp.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)), round(time.perf_counter() - t, 3))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.splitlines()[-1]  # fmt: skip
    print("--help:", out)
    assert out.startswith("[] "), out


def test_malformed_config_json_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    assert main(["explain", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json is not valid JSON" in err[0], err
    (tmp_path / "config.json").write_text('{"model_type": "no-such-type"}')
    assert main(["plan", str(tmp_path), "--gpus", "8", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a transformers config" in err[0], err


def test_plan_says_how_many_candidates_were_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--hardware", "h100", "--top", "10"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "dropped" in ln)
    assert "candidates" in line and "GiB usable per GPU" in line, line


def test_vpp_without_a_pipeline_is_refused() -> None:
    with pytest.raises(UserInputError, match=r"vpp=2 .* pp=1 has one stage"):
        autotp.parallelize(build_model("llama-tiny"), vpp=2, pp=1)
    with pytest.raises(UserInputError, match=r"vpp=2 .* pp=1 has one stage"):
        autotp.compile_rank(build_model("llama-tiny"), tp=2, vpp=2)


class _Lazy(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.embed, self.proj = nn.Embedding(16, 8, sparse=sparse), nn.LazyLinear(8) if not sparse else nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(input_ids))
        for layer in self.layers:
            h = layer(h)
        return h.sum()


def test_a_lazy_module_that_has_not_run_is_named() -> None:
    with pytest.raises(UserInputError, match=r"weight of module proj \(LazyLinear\) has no shape yet.*run the model once"):
        autotp.compile_rank(_Lazy(), tp=2, example_inputs={"input_ids": torch.zeros(2, 4, dtype=torch.long)}, device="meta")


def test_example_inputs_the_forward_does_not_take_are_named() -> None:
    """An ``nn.Sequential`` takes ``input``: inputs under another name were an export failure that
    blamed an operation in module <root> at a line of ``inspect``."""
    with pytest.raises(UserInputError, match=r"inputs \(input_ids\) do not fit Sequential.forward\(input\).*parameter names"):
        autotp.compile_rank(nn.Sequential(nn.Linear(4, 4)), tp=2, example_inputs={"input_ids": torch.randn(2, 4)}, device="meta")


def test_sparse_embedding_gradients_are_refused_when_split() -> None:
    with pytest.raises(UserInputError, match=r"module embed \(Embedding\).*sparse gradient.*make the embedding with sparse=False"):
        autotp.compile_rank(_Lazy(sparse=True), tp=1, pp=2, example_inputs={"input_ids": torch.zeros(2, 4, dtype=torch.long)}, device="meta")


def test_unknown_compile_backend_is_refused() -> None:
    with pytest.raises(UserInputError, match="compile='inductr' is not a torch.compile backend"):
        autotp.parallelize(nn.Linear(4, 4), example_inputs={"input": torch.randn(2, 4)}, compile="inductr")


def test_world_size_error_shows_no_inferred_dp() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        with pytest.raises(UserInputError) as info:
            autotp.parallelize(build_model("llama-tiny"), tp=2, pp=2)
    finally:
        dist.destroy_process_group()
    assert "dp=0" not in str(info.value) and "tp*pp = 2*2 = 4 does not divide the world size 3" in str(info.value)


_UNTRACEABLE = '''
import torch
from torch import nn


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum().item() > 0:
            return x * 2
        return x
'''


def test_trace_error_names_a_user_file_under_a_folder_named_autotp(tmp_path: Path) -> None:
    path = tmp_path / "autotp" / "user_model.py"
    path.parent.mkdir()
    path.write_text(_UNTRACEABLE)
    spec = importlib.util.spec_from_file_location("user_model_under_autotp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(UserInputError) as info:
        autotp.compile_rank(module.DataDependent(), tp=1, example_inputs={"x": torch.randn(2, 8)}, device="cpu")
    assert f"{path}:8" in str(info.value), info.value


@torch.library.custom_op("autotp_test_errors::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class _CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _twice(self.lin(x))


def test_missing_fake_kernel_gets_specific_advice() -> None:
    with pytest.raises(UserInputError) as info:
        autotp.compile_rank(_CustomOp(), tp=1, example_inputs={"x": torch.randn(2, 4)}, device="cpu")
    message = str(info.value)
    assert 'torch.library.register_fake("autotp_test_errors::twice")' in message
    assert "make that module traceable" not in message


def test_vocab_parallel_ops_refuse_ids_outside_the_vocabulary() -> None:
    weight = torch.randn(4, 3)
    with pytest.raises(UserInputError, match=r"2 token ids are outside the vocabulary \(from -1 to 9\).*\[0, 8\)"):
        ops.VOCAB_PARALLEL_EMBEDDING(weight, torch.tensor([[0, 9, 3, -1]]), 0, 4, 8, -1)
    assert ops.VOCAB_PARALLEL_EMBEDDING(weight, torch.tensor([[0, 7]]), 0, 4, 8, -1)[0, 1].abs().sum() == 0
    with torch._subclasses.FakeTensorMode():  # while tracing the check is an async assert, not an error
        ops.VOCAB_PARALLEL_EMBEDDING(torch.empty(4, 3), torch.zeros(1, 2, dtype=torch.long), 0, 4, 8, -1)


def _mistakes(rank: int, world: int) -> dict[str, str]:
    """Each rank makes the calls of issue 16 and returns what each raised."""
    torch.manual_seed(0)
    model = build_model("llama-tiny", device="cpu", dtype=torch.float32)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    pm = autotp.parallelize(model, tp=world, example_inputs={"input_ids": ids, "labels": ids})
    calls: dict[str, dict[str, Any]] = {
        "ids": {"input_ids": ids.masked_fill(ids == ids[0, 3], vocab + 5), "labels": ids},
        "labels": {"input_ids": ids, "labels": ids.masked_fill(ids == ids[0, 3], vocab)},
        "ignored_labels": {"input_ids": ids, "labels": ids.masked_fill(ids == ids[0, 3], -100)},
        "batches": {"input_ids": ids if rank == 0 else ids.flip(0), "labels": ids},
        "lengths": {"input_ids": ids[:, : 16 - 8 * rank], "labels": ids[:, : 16 - 8 * rank]},
        "float_ids": {"input_ids": ids.float(), "labels": ids},
        "flat_ids": {"input_ids": ids[0], "labels": ids[0]},
    }
    raised = {}  # on gloo the inputs are compared on every call, not only the first two
    for name, call in calls.items():
        try:
            pm.train_step(**call)
            raised[name] = ""
        except Exception as e:  # noqa: BLE001 - reported to the test
            raised[name] = f"{type(e).__name__}: {e}"
    return raised


def test_mistakes_across_ranks_raise_naming_the_cause() -> None:
    for rank, raised in enumerate(run_on_ranks(_mistakes, 2, timeout_s=300)):
        print(rank, raised)
        assert "UserInputError" in raised["ids"] and f"token ids are outside the vocabulary (from {261} to 261)" in raised["ids"]
        assert "UserInputError" in raised["labels"] and "labels (other than ignore_index)" in raised["labels"]
        assert raised["ignored_labels"] == ""
        assert "ranks 0 and 1 of a tp group were passed different input values" in raised["batches"]
        assert "different input shapes (arg0" not in raised["lengths"] and "different input shapes" in raised["lengths"]
        assert "argument 'input_ids' is float32" in raised["float_ids"]
        assert "argument 'input_ids' is int64 with 1 dims" in raised["flat_ids"]


class _DrawnStream(nn.Module):
    """Reads one of four streams, drawn with Python's ``random`` when built (hyper-connections' habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.stream = random.randrange(4)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x[:, self.stream]))).square().mean()


def _different_models(rank: int, world: int) -> dict[str, str]:
    """Each rank builds its model as a user who forgot a seed would; returns what parallelize raised."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    raised = {}
    for name in ("unseeded", "drawn_structure", "seeded"):
        torch.manual_seed(rank if name == "unseeded" else 0)
        random.seed(rank if name == "drawn_structure" else 0)
        if name == "drawn_structure":
            model, inputs = _DrawnStream(), {"x": torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))}
        else:
            model, inputs = build_model("llama-tiny", device="cpu", dtype=torch.float32), {"input_ids": ids, "labels": ids}
        try:
            autotp.parallelize(model, tp=world, example_inputs=inputs)
            raised[name] = ""
        except UserInputError as e:
            raised[name] = str(e)
    return raised


def test_ranks_that_built_different_models_are_refused_naming_what_differs() -> None:
    """Every rank shards its own copy: values drawn unseeded, or a structure drawn with Python's
    random, would train a model no rank built; parallelize refuses on every rank."""
    for raised in run_on_ranks(_different_models, 2, timeout_s=300):
        assert "ranks 0 and 1 built different models" in raised["unseeded"], raised
        assert "hold different values, e.g. parameter model.embed_tokens.weight" in raised["unseeded"]
        assert "torch.manual_seed(0)" in raised["unseeded"]
        assert "ranks 0 and 1 traced different graphs" in raised["drawn_structure"], raised
        assert "random.seed(0)" in raised["drawn_structure"]
        assert raised["seeded"] == ""


def _last_stage_raises(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)  # every rank builds the same model (parallelize refuses ranks that built different ones)
    model = build_model("llama-tiny", device=device, dtype=torch.float32)
    ids = torch.zeros((4, 8), dtype=torch.long, device=device)
    pm = autotp.parallelize(model, tp=1, pp=2, example_inputs={"input_ids": ids}, timeout_s=300)

    def loss_fn(out: Any) -> torch.Tensor:
        raise ValueError("boom in the loss of the last stage")

    start = time.monotonic()
    try:
        pm.train_step(input_ids=ids, loss_fn=loss_fn, num_microbatches=2)
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - start}
    if rank == 1:  # stay alive, as a rank stuck in its teardown would; the peer must not wait for it
        try:
            while time.monotonic() - start < 60 and not store.check(["autotp_test/peer_done"]):
                time.sleep(0.2)
        except RuntimeError:  # rank 0 held the store and has exited
            pass
    else:
        store.set("autotp_test/peer_done", "1")
    return result


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_a_stage_that_raises_reaches_the_waiting_peer_within_30_s(backend: str, capfd: pytest.CaptureFixture[str]) -> None:
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    start = time.monotonic()
    try:
        results = spawn_ranks(_last_stage_raises, 2, backend=backend, timeout_s=120, num_threads=1)
    except RankError as e:  # rank 0 was blocked in a wait that could not be aborted (gloo) and exited
        assert e.rank == 0 and "exited with code 1" in str(e), e
        err = capfd.readouterr().err
        assert "autotp: rank 1 failed: ValueError: boom in the loss of the last stage; rank 0 was waiting" in err, err
    else:
        print(results)
        assert "boom in the loss of the last stage" in results[0]["error"] and results[0]["after_s"] < 30, results
    assert time.monotonic() - start < 90


def _failure_then_new_watch(rank: int, world: int) -> tuple[str | None, str | None]:
    import torch.distributed as dist

    from autotp.runtime.execution.guards import FailureWatch

    first = FailureWatch()  # a model whose first call failed on rank 1
    if rank == 1:
        with pytest.raises(RuntimeError), first.call():
            raise RuntimeError("the first model failed")
    dist.barrier()
    second = FailureWatch()  # the next model, in its first call
    with second.call():
        stale = second._peer_cause()
    dist.barrier()
    if rank == 1:
        with pytest.raises(RuntimeError), second.call():
            raise RuntimeError("the second model failed")
    dist.barrier()
    with second.call() if rank == 0 else contextlib.nullcontext():
        noticed = second._peer_cause() if rank == 0 else None
    return stale, noticed


def test_a_failure_of_one_model_does_not_fail_the_next() -> None:
    """A failed call of one ParallelModel is no peer failure for the next model's calls (the
    sweep's roformer: a tp=2 failure aborted the pp=2 model built after it), but a failure of
    that next model still is."""
    (stale0, noticed0), (stale1, _) = run_on_ranks(_failure_then_new_watch, 2, timeout_s=120)
    assert stale0 is None and stale1 is None, (stale0, stale1)
    assert noticed0 is not None and "rank 1 failed: RuntimeError: the second model failed" in noticed0, noticed0


def _user_error_after_the_store_left(rank: int, world: int) -> tuple[bool, str]:
    import torch.distributed as dist

    from autotp.runtime.execution.guards import FailureWatch

    watch = FailureWatch()
    if rank == 0:  # hosts the store and is done: its process ends and the store with it
        return True, ""
    store, gone, deadline = dist.distributed_c10d._get_default_store(), False, time.monotonic() + 60
    while not gone and time.monotonic() < deadline:
        try:
            store.check(["probe"])
            time.sleep(0.1)
        except RuntimeError:
            gone = True
    with pytest.raises(UserInputError) as info, watch.call():
        raise UserInputError("refused on every rank")
    return gone, str(info.value)


def test_a_user_error_after_the_store_host_finished_stays_the_error() -> None:
    """Every rank refused the same input and the rank hosting the store finished first (CI:
    zero-bubble with compile): the others' error is theirs, not the store's closed connection."""
    (_, _), (gone, message) = run_on_ranks(_user_error_after_the_store_left, 2, timeout_s=120)
    assert gone and message == "refused on every rank", (gone, message)


def _raise_user_error(rank: int, world: int) -> None:
    raise UserInputError(f"bad input on rank {rank}")


def test_rank_error_of_a_user_error_is_one_line_with_a_log() -> None:
    with pytest.raises(RankError) as info:
        spawn_ranks(_raise_user_error, 2, backend="gloo", timeout_s=120, num_threads=1)
    e = info.value
    assert e.user_error and len(str(e).splitlines()) == 1, str(e)
    log_file = Path(str(e).rsplit("traceback in ", 1)[1].rstrip(")"))
    assert "_raise_user_error" in log_file.read_text()


def _capture_then_tear_down(rank: int, world: int) -> float:
    import torch.distributed as dist

    from autotp.runtime.execution import cudagraphs

    torch.cuda.set_device(rank)
    model = build_model("llama-tiny", device="cuda", dtype=torch.float32)
    ids = torch.zeros((2, 16), dtype=torch.long, device="cuda")
    pm = autotp.parallelize(model, tp=world, example_inputs={"input_ids": ids, "labels": ids}, cuda_graphs=True)
    for _ in range(2):
        pm.train_step(input_ids=ids, labels=ids)
    start = time.monotonic()
    cudagraphs.release_all()
    dist.destroy_process_group()
    return time.monotonic() - start


@pytest.mark.gpu
def test_teardown_after_cuda_graph_capture_does_not_hang() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    seconds = spawn_ranks(_capture_then_tear_down, 2, backend="nccl", timeout_s=120)
    print("release_all + destroy_process_group:", seconds)
    assert max(seconds) < 10, seconds


_TORCHRUN_SCRIPT = _UNTRACEABLE + '''

import autotp

autotp.init_distributed()
autotp.parallelize(DataDependent(), tp=2, example_inputs={"x": torch.randn(2, 8)})
'''


def test_torchrun_prints_a_user_error_once(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                            capture_output=True, text=True, timeout=300, env=env, check=False)  # fmt: skip
    output = result.stdout + result.stderr
    print(output)
    assert result.returncode != 0
    errors = [ln for ln in output.splitlines() if "could not trace DataDependent" in ln]
    assert len(errors) == 1 and errors[0].startswith("autotp: error on rank "), errors
    assert f"{script}:8" in errors[0] and "traceback in " in errors[0]
    assert "def forward" not in output and len(output.splitlines()) < 80


def test_traceback_logs_do_not_pile_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from autotp.runtime.processes import launcher

    monkeypatch.setattr(launcher.tempfile, "gettempdir", lambda: str(tmp_path))
    written = [launcher._write_log(rank, f"traceback {rank}") for rank in range(launcher.KEPT_LOGS + 8)]
    kept = sorted(launcher.log_folder().glob("*.log"))
    assert len(kept) == launcher.KEPT_LOGS and written[-1] in kept and written[-1].read_text().endswith(str(launcher.KEPT_LOGS + 7))
    assert list(tmp_path.glob("*.log")) == []  # all in one folder, not scattered over the temp folder


def test_a_log_another_rank_deletes_meanwhile_is_left_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from autotp.runtime.processes import launcher

    monkeypatch.setattr(launcher.tempfile, "gettempdir", lambda: str(tmp_path))
    real_glob = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: [*real_glob(self, pattern), self / "deleted-by-rank1.log"])
    written = launcher._write_log(0, "traceback 0")
    assert written.read_text() == "traceback 0"


_RETRACE_1D = """
import torch, autotp
from autotp.ir.errors import UserInputError
from autotp.presets import build_model
model = build_model("llama-tiny", device="cpu", dtype=torch.float32)
ids = torch.zeros((2, 16), dtype=torch.long)
pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": ids, "labels": ids})
try:
    pm(input_ids=ids[0], labels=ids[0])
except UserInputError as e:
    print(e)
"""


def test_a_retrace_that_fails_prints_one_error_not_the_fake_tensor_log() -> None:
    done = subprocess.run([sys.executable, "-c", _RETRACE_1D], capture_output=True, text=True, timeout=300, check=True)
    assert "argument 'input_ids' is int64 with 1 dims" in done.stdout, done.stdout
    assert "failed while attempting to run meta" not in done.stderr and "Traceback" not in done.stderr, done.stderr[:2000]
