import argparse
import functools
import itertools
from collections import Counter

import pytest

from autotp.cli.schedule import add_schedule_command
from autotp.cost_model.memory import in_flight
from autotp.ir.schedules import (
    Action,
    buffer_slots,
    check_schedule,
    format_actions,
    format_megatron,
    gpipe,
    Message,
    interleaved_one_f_one_b,
    messages,
    one_f_one_b,
    parse,
    receive_slots,
    schedule,
    simulate,
    slots_per_chunk,
    timeline,
    zero_bubble_h1,
)

# Seed 002, interleaved 1F1B with microbatches=8, PP=4, VPP=2, PP rank 0, as Megatron's
# get_schedule_table + convert_schedule_table_to_order build it (its "Step 3"), typed from its text.
SEED_SCHEDULE_TABLE = [  # (microbatch_id, model_chunk_id), the forward order of every rank
    (0, 0), (1, 0), (2, 0), (3, 0),
    (0, 1), (1, 1), (2, 1), (3, 1),
    (4, 0), (5, 0), (6, 0), (7, 0),
    (4, 1), (5, 1), (6, 1), (7, 1),
]  # fmt: skip
SEED_WARMUP = [1, 1, 1, 1, 2, 2, 2, 2, 1, 1]
SEED_STEADY = [[1, -2], [1, -2], [2, -2], [2, -2], [2, -1], [2, -1]]
SEED_COOLDOWN = [-1, -1, -2, -2, -2, -2, -1, -1, -1, -1]
SEED_RANK0_ORDER = SEED_WARMUP + [i for pair in SEED_STEADY for i in pair] + SEED_COOLDOWN


def _megatron(actions: list[Action]) -> list[int]:
    return [int(token) for token in format_megatron(actions).split()]


def test_seed_interleaved_order_rank0() -> None:
    assert _megatron(interleaved_one_f_one_b(4, 2, 8, 0)) == SEED_RANK0_ORDER


def test_seed_schedule_table_is_every_ranks_forward_order() -> None:
    for rank in range(4):
        order = interleaved_one_f_one_b(4, 2, 8, rank)
        assert [(a.microbatch, a.chunk) for a in order if a.kind == "F"] == SEED_SCHEDULE_TABLE
        # backwards follow the same table with the chunks reversed (Megatron: chunk_id - num_model_chunks)
        assert [(a.microbatch, 1 - a.chunk) for a in order if a.kind == "B"] == SEED_SCHEDULE_TABLE


def test_interleaved_warmup_is_megatrons_formula() -> None:
    for rank in range(4):
        order = interleaved_one_f_one_b(4, 2, 8, rank)
        warmup = next(i for i, a in enumerate(order) if a.kind == "B") - 1  # the first steady forward precedes it
        assert warmup == (4 - rank - 1) * 2 + (2 - 1) * 4
    # capped at microbatches*vpp: rank 0 of pp=4, vpp=4, 4 microbatches would warm up 6 + 12 > 16
    order = interleaved_one_f_one_b(4, 4, 4, 0)
    assert [a.kind for a in order] == ["F"] * 16 + ["B"] * 16


def test_one_f_one_b_order() -> None:
    assert format_megatron(one_f_one_b(4, 8, 0)) == "1 1 1 1 -1 1 -1 1 -1 1 -1 1 -1 -1 -1 -1"
    assert format_megatron(one_f_one_b(4, 8, 3)) == " ".join(["1 -1"] * 8)
    assert format_actions(one_f_one_b(2, 3, 0)) == "F0.0 F0.1 B0.0 F0.2 B0.1 B0.2"
    assert format_actions(gpipe(2, 3, 1)) == "F0.0 F0.1 F0.2 B0.0 B0.1 B0.2"


def test_text_form_parses_back() -> None:
    actions = interleaved_one_f_one_b(4, 3, 8, 1)
    assert parse(format_actions(actions)) == actions
    assert str(Action("B", 1, 12)) == "B1.12" and Action("B", 1, 12).megatron == -2
    with pytest.raises(ValueError, match=r"cannot parse schedule action '2F0'"):
        parse("F0.0 2F0")


CASES = [(pp, vpp, m) for pp in (1, 2, 3, 4, 8) for vpp in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8, 12, 16)]


def _schedules(pp: int, vpp: int, m: int) -> dict[str, functools.partial[list[Action]]]:
    if vpp > 1:
        if pp < 2 or m % pp:
            return {}
        return {"interleaved": functools.partial(interleaved_one_f_one_b, pp, vpp, m)}
    return {"gpipe": functools.partial(gpipe, pp, m), "1f1b": functools.partial(one_f_one_b, pp, m)}


@pytest.mark.parametrize(("pp", "vpp", "m"), CASES)
def test_every_action_once_backward_after_forward_no_deadlock(pp: int, vpp: int, m: int) -> None:
    for name, fn in _schedules(pp, vpp, m).items():
        for rank in range(pp):
            order = fn(rank)
            counts = Counter(order)
            assert set(counts.values()) == {1}, (name, rank)
            assert set(counts) == {Action(k, c, i) for k in ("F", "B") for c in range(vpp) for i in range(m)}
            position = {a: i for i, a in enumerate(order)}
            assert all(position[Action("F", a.chunk, a.microbatch)] < i for i, a in enumerate(order) if a.kind == "B")
        steps = simulate(pp, vpp, m, fn)
        if name != "interleaved":
            assert steps == (m + pp - 1) * 2, name
        else:
            assert steps == (m * vpp + pp - 1) * 2
            # bubble (idle over busy steps) is (pp-1)/(m*vpp), below 1F1B's (pp-1)/m
            assert steps / (2 * m * vpp) - 1 == pytest.approx((pp - 1) / (m * vpp))
            assert steps / (2 * m * vpp) < simulate(pp, 1, m, functools.partial(one_f_one_b, pp, m)) / (2 * m)


def test_seed_annotated_listing_deadlocks() -> None:
    # Seed 002 also shows rank 0's order hand-annotated; its steady and cooldown phases differ
    # from the Step 3 derivation and Megatron's code, and cannot run: its first backward is
    # chunk 0's, which needs (through ranks 1-3) chunk 1's backward of the same microbatch,
    # and rank 0 runs that one later.
    listing = [1, 1, 1, 1, 2, 2, 2, 2, 1, 1,
               1, -1, 1, -1, 2, -2, 2, -2, 2, -1, 2, -1,
               -2, -2, -1, -1, -2, -2, -1, -1, -2, -2]  # fmt: skip
    seen: Counter[int] = Counter()
    actions = []
    for value in listing:  # each chunk runs its forwards, and its backwards, in microbatch order
        actions.append(Action("F" if value > 0 else "B", abs(value) - 1, seen[value]))
        seen[value] += 1

    def rank_order(rank: int) -> list[Action]:
        return actions if rank == 0 else interleaved_one_f_one_b(4, 2, 8, rank)

    with pytest.raises(
        ValueError, match=r"deadlocks after 17 steps: rank 0 at B0.0 waits for B0.0 on rank 1; .*rank 3 at B0.0 waits "
        r"for B1.0 on rank 0$"
    ):
        simulate(4, 2, 8, rank_order)


def test_simulate_rejects_missing_and_repeated_actions() -> None:
    def orders(rank: int) -> list[Action]:
        return parse("F0.0 F0.1 B0.0 B0.1" if rank == 0 else "F0.0 B0.0 F0.1 B0.0")

    with pytest.raises(
        ValueError, match=r"rank 1 must run each action once: missing \['B0.1'\], extra or repeated \['B0.0'\]"
    ):
        simulate(2, 1, 2, orders)


def test_check_schedule_says_what_is_allowed() -> None:
    check_schedule(4, 1, 4)
    check_schedule(4, 1, 2, "gpipe")
    check_schedule(4, 2, 8)
    with pytest.raises(ValueError, match=r"1F1B needs at least as many microbatches as pipeline stages: got 3 for pp="):
        check_schedule(4, 1, 3)
    with pytest.raises(ValueError, match=r"use 4 or more microbatches, or the gpipe schedule$"):
        check_schedule(4, 1, 3)
    with pytest.raises(ValueError, match=r"multiple of pp=4, got 6: use 4, 8, 12, ..."):
        check_schedule(4, 2, 6)
    with pytest.raises(ValueError, match=r"interleaved 1F1B needs pp >= 2 and vpp >= 2, got pp=1, vpp=2"):
        check_schedule(1, 2, 4)
    with pytest.raises(ValueError, match=r"the 1f1b schedule runs one chunk per rank, got vpp=2"):
        check_schedule(4, 2, 8, "1f1b")
    with pytest.raises(ValueError, match=r"unknown schedule 'zb': choose one of gpipe, 1f1b, interleaved"):
        check_schedule(4, 1, 8, "zb")
    with pytest.raises(ValueError, match=r"microbatches must be at least 1, got 0"):
        check_schedule(4, 1, 0)
    with pytest.raises(ValueError, match=r"rank 4 is not a pipeline stage of pp=4 \(0..3\)"):
        schedule("1f1b", 4, 1, 8, 4)
    with pytest.raises(ValueError, match="multiple of pp=4"):
        interleaved_one_f_one_b(4, 2, 6, 0)


def _schedule_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    parser = argparse.ArgumentParser()
    add_schedule_command(parser.add_subparsers())
    args = parser.parse_args(["schedule", *argv])
    assert args.handler(args) == 0
    return capsys.readouterr().out


def test_schedule_command(capsys: pytest.CaptureFixture[str]) -> None:
    out = _schedule_cli(capsys, "--pp", "4", "--vpp", "2", "--microbatches", "8", "--rank", "0")
    assert out == " ".join(map(str, SEED_RANK0_ORDER)) + "\n"
    out = _schedule_cli(capsys, "--pp", "4", "--microbatches", "8", "--rank", "3", "--format", "actions")
    assert parse(out) == one_f_one_b(4, 8, 3)
    out = _schedule_cli(capsys, "--pp", "2", "--microbatches", "2", "--schedule", "gpipe")
    assert out == "rank 0: 1 1 -1 -1\nrank 1: 1 1 -1 -1\n"


@pytest.mark.parametrize("pp", [2, 4])
def test_schedule_dispatch_matches_the_functions(pp: int) -> None:
    for rank, m in itertools.product(range(pp), (pp, 2 * pp)):
        assert schedule("1f1b", pp, 1, m, rank) == one_f_one_b(pp, m, rank)
        assert schedule("gpipe", pp, 1, m, rank) == gpipe(pp, m, rank)
        assert schedule("interleaved", pp, 2, m, rank) == interleaved_one_f_one_b(pp, 2, m, rank)


@pytest.mark.parametrize("name,pp,vpp,microbatches", [("1f1b", 4, 1, 4), ("1f1b", 4, 1, 12), ("gpipe", 3, 1, 5), ("interleaved", 2, 3, 6)])
def test_buffer_slots_never_share_a_slot_between_microbatches_in_flight(name: str, pp: int, vpp: int, microbatches: int) -> None:
    for rank in range(pp):
        actions = schedule(name, pp, vpp, microbatches, rank)
        slots = buffer_slots(actions)
        in_flight: dict[tuple[int, int], int] = {}
        for a in actions:
            key = (a.chunk, a.microbatch)
            if a.kind == "F":
                assert (a.chunk, slots[key]) not in in_flight.values(), (rank, str(a))
                in_flight[key] = (a.chunk, slots[key])
            else:
                del in_flight[key]
        assert not in_flight


def test_1f1b_needs_pp_minus_rank_slots_whatever_the_microbatches() -> None:
    for microbatches in (4, 8, 32):
        per_rank = [max(buffer_slots(one_f_one_b(4, microbatches, r)).values()) + 1 for r in range(4)]
        assert per_rank == [4, 3, 2, 1]
    assert max(buffer_slots(gpipe(4, 8, 0)).values()) + 1 == 8
    assert slots_per_chunk("1f1b", 4, 1, 1) == {0: 3}


# ---- zero bubble (ZB-H1) -------------------------------------------------------------------


def test_zbh1_defers_rank_weight_gradients() -> None:
    assert format_actions(zero_bubble_h1(2, 3, 0)) == "F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 B0.2 W0.2"
    assert format_actions(zero_bubble_h1(2, 3, 1)) == "F0.0 B0.0 F0.1 B0.1 W0.0 F0.2 B0.2 W0.1 W0.2"
    assert schedule("zbh1", 4, 1, 8, 2) == zero_bubble_h1(4, 8, 2)
    with pytest.raises(ValueError, match="no weight-gradient action"):
        format_megatron(zero_bubble_h1(2, 2, 0))
    assert parse(format_actions(zero_bubble_h1(3, 5, 1))) == zero_bubble_h1(3, 5, 1)
    with pytest.raises(ValueError, match=r"ZB-H1 needs at least as many microbatches as pipeline stages: got 2 for pp=4"):
        check_schedule(4, 1, 2, "zbh1")
    with pytest.raises(ValueError, match=r"the zbh1 schedule runs one chunk per rank, got vpp=2"):
        check_schedule(4, 2, 8, "zbh1")


@pytest.mark.parametrize(("pp", "m"), [(2, 2), (2, 8), (3, 5), (4, 4), (4, 16), (8, 8), (8, 24)])
def test_zbh1_bubble_is_a_third_of_1f1b_at_1f1b_peak_memory(pp: int, m: int) -> None:
    """F, B and W one step each: ZB-H1 takes 3m + p - 1 steps; 1F1B (B+W fused, 2 steps)
    takes 3(m + p - 1). Every rank holds at most pp microbatches between F and W."""
    fn = functools.partial(zero_bubble_h1, pp, m)
    assert simulate(pp, 1, m, fn) == 3 * m + pp - 1
    for rank in range(pp):
        order = fn(rank)
        live = peak = 0
        for a in order:
            live += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        assert peak == min(pp, m)
        assert max(buffer_slots(order).values()) + 1 == min(pp, m)
        position = {a: i for i, a in enumerate(order)}
        assert all(position[Action("B", 0, a.microbatch)] < i for i, a in enumerate(order) if a.kind == "W")


# ---- point-to-point plan ---------------------------------------------------------------------


def _orders(name: str, pp: int, vpp: int, m: int) -> functools.partial[list[Action]]:
    return functools.partial(schedule, name, pp, vpp, m)


PLANS = [("gpipe", 2, 1, 4), ("1f1b", 2, 1, 8), ("1f1b", 4, 1, 8), ("zbh1", 2, 1, 4), ("zbh1", 4, 1, 8),
         ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8), ("interleaved", 2, 3, 6), ("interleaved", 3, 2, 3)]  # fmt: skip


def _nccl_completes(pp: int, times: list[dict[Action, int]], msgs: list[Message], recv_step: dict[Message, int]) -> bool:
    """Run posted batches under NCCL's rules; True if every compute and batch finishes.

    The host never blocks. Each rank posts its batches in step order (``recv_step``
    moves a message's receive to another step); a rank's batches of one group run in
    post order on one stream, each once the computes before its post have run; a batch
    finishes once the batches holding the matching operations have started (the k-th
    send from r to p in a group matches the k-th receive at p from r). A compute runs
    after the previous one and after the batch holding its receive.
    """
    batches: dict[tuple[int, str, int], list[tuple[bool, int, int]]] = {}  # (rank, group, step) -> (send?, peer, k)
    where: dict[tuple[bool, int, int, str, int], tuple[int, str, int]] = {}
    counts: Counter[tuple[bool, int, int, str]] = Counter()
    posts = sorted([(m.step, True, m) for m in msgs] + [(recv_step.get(m, m.step), False, m) for m in msgs],
                   key=lambda p: (p[0], p[1]))  # fmt: skip
    for step, send, m in posts:
        me, peer = (m.src, m.dst) if send else (m.dst, m.src)
        k = counts[send, me, peer, m.kind]
        counts[send, me, peer, m.kind] += 1
        batches.setdefault((me, m.kind, step), []).append((send, peer, k))
        where[send, me, peer, m.kind, k] = (me, m.kind, step)
    reads = {}  # (rank, action) -> the batch holding its receive
    for m in msgs:
        chunk = ((m.stage + 1) if m.kind == "F" else (m.stage - 1)) // pp
        reads[m.dst, Action(m.kind, chunk, m.microbatch)] = (m.dst, m.kind, recv_step.get(m, m.step))
    computed: set[tuple[int, Action]] = set()
    started: set[tuple[int, str, int]] = set()
    finished: set[tuple[int, str, int]] = set()
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            order = sorted(times[rank], key=times[rank].__getitem__)
            for action in order:
                key = (rank, action)
                if key in computed:
                    continue
                if key in reads and reads[key] not in finished:
                    break
                computed.add(key)
                progress = True
            for group in ("F", "B"):
                mine = sorted(b for b in batches if b[0] == rank and b[1] == group)
                for batch in mine:
                    step = batch[2]
                    before = all((rank, a) in computed for a in order if times[rank][a] < step)
                    if batch not in started and before:
                        started.add(batch)
                        progress = True
                    if batch in started and batch not in finished and all(
                        where[not send, peer, rank, group, k] in started for send, peer, k in batches[batch]
                    ):
                        finished.add(batch)
                        progress = True
                    if batch not in finished:
                        break
    return len(computed) == sum(len(t) for t in times) and finished == set(batches)


@pytest.mark.parametrize(("name", "pp", "vpp", "m"), PLANS)
def test_point_to_point_plan_cannot_deadlock_under_nccl_ordering(name: str, pp: int, vpp: int, m: int) -> None:
    times = timeline(pp, vpp, m, _orders(name, pp, vpp, m))
    assert _nccl_completes(pp, times, messages(pp, vpp, times), {})


def test_nccl_model_catches_a_receive_posted_before_the_send_it_waits_behind() -> None:
    """The model's own check: in an interleaved pipeline on 2 ranks, rank 0 posting the
    receive of its second chunk's first input at step 0, ahead of sending its first
    chunk's output (which rank 1 needs to produce that input), blocks both forever."""
    pp, vpp, m = 2, 2, 2
    times = timeline(pp, vpp, m, _orders("interleaved", pp, vpp, m))
    msgs = messages(pp, vpp, times)
    early = next(x for x in msgs if x.kind == "F" and x.stage == 1 and x.microbatch == 0)
    assert _nccl_completes(pp, times, msgs, {})
    assert not _nccl_completes(pp, times, msgs, {early: 0})


@pytest.mark.parametrize(("name", "pp", "vpp", "m"), PLANS)
def test_receive_buffers_are_reused_only_after_their_last_reader(name: str, pp: int, vpp: int, m: int) -> None:
    times = timeline(pp, vpp, m, _orders(name, pp, vpp, m))
    release = "W" if name == "zbh1" else "B"
    for rank in range(pp):
        received = [x for x in messages(pp, vpp, times) if x.dst == rank]
        slots = receive_slots(pp, times, received, rank)
        busy: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
        for x, slot in slots.items():
            chunk = ((x.stage + 1) if x.kind == "F" else (x.stage - 1)) // pp
            until = times[rank][Action(release, chunk, x.microbatch)]
            assert x.step <= times[rank][Action(x.kind, chunk, x.microbatch)]  # posted before it is read
            for start, end in busy.get((x.kind, chunk, slot), []):
                assert end < x.step or until < start, (rank, x)
            busy.setdefault((x.kind, chunk, slot), []).append((x.step, until))
        # buffers follow the microbatches in flight (plus one posted ahead), not the microbatches
        per_pool = Counter((k, c) for k, c, _ in busy)
        assert max(per_pool.values(), default=0) <= in_flight(name, pp, vpp, m, rank) + 1
