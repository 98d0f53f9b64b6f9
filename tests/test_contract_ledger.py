"""Known answers for the ledger's promises: the exit code for every mix of done / failed / pending shards, one
winner of a claim race (on disk and on the local S3 and GCS servers), the object stores' conditional create and
the lock's exit 4 on them. Written against behaviour (who wins, what code), not against the records' fields."""

import json
import multiprocessing
import os
import threading

import pyarrow as pa
import pytest
from conftest import launch

from launcher.errors import ConfigError, LockHeld
from launcher.ledger.claims import Claims
from launcher.ledger.lock import RunLock
from launcher.ledger.states import Ledger
from launcher.ledger.store import Store
from launcher.plan.plan import Plan, ShardPlan

# shard states after the run -> the launcher's exit code, written out (DESIGN.md "Exit status"):
# 0 every selected shard is done (or held by another live run, which answers for it); 3 anything else not done.
# "held" is a pending shard, "held_failed" a failed one, whose newest claim belongs to another live run.
EXIT_TABLE = [
    ((), 0),
    (("done",), 0),
    (("failed",), 3),
    (("pending",), 3),
    (("held",), 0),
    (("held_failed",), 0),
    (("done", "done"), 0),
    (("done", "failed"), 3),
    (("done", "pending"), 3),
    (("failed", "pending"), 3),
    (("done", "held"), 0),
    (("failed", "held"), 3),
    (("pending", "held"), 3),
    (("done", "failed", "pending"), 3),
    (("done", "held", "held_failed"), 0),
    (("done", "failed", "pending", "held"), 3),
]


def _ledger_with(tmp_path, kinds):
    store = Store(tmp_path)
    shards = [ShardPlan(i, 2, f"fp{i}", "pending") for i in range(len(kinds))]
    other = Claims(store, 1, "other-run")
    for i, kind in enumerate(kinds):
        if kind.startswith("held"):  # claimed first: a claim is not taken on a shard finished since the run began
            assert other.try_claim(i)
        if kind == "done":
            store.write_json(
                f"state/shard-{i:05d}.json",
                {"status": "done", "rows": 2, "run_id": "this-run", "prompts_fingerprint": f"fp{i}"},
            )
        if kind in ("failed", "held_failed"):
            store.write_json(f"state/shard-{i:05d}.json", {"status": "failed", "rows": 0, "run_id": "this-run"})
    return store, Plan(shards, list(range(len(kinds))), [])


@pytest.mark.parametrize(("kinds", "expected"), EXIT_TABLE)
@pytest.mark.parametrize("workers_code", [0, 3])
def test_the_exit_code_is_decided_by_the_ledger(tmp_path, kinds, expected, workers_code):
    from launcher.host.summary import summarize

    with RunLock(Store(tmp_path), 1, "other-run"):  # the other run is alive while it holds its lock
        store, plan = _ledger_with(tmp_path, kinds)
        _, record = summarize(store, Ledger(store), plan, "this-run", 0.0, workers_code, ["./launch.sh"])
    assert record["exit_code"] == expected


@pytest.mark.parametrize("signal_or_crash", [1, 130, 137, 143])
def test_a_signal_or_crash_keeps_its_own_code(tmp_path, signal_or_crash):
    from launcher.host.summary import summarize

    store, plan = _ledger_with(tmp_path, ("done",))
    _, record = summarize(store, Ledger(store), plan, "this-run", 0.0, signal_or_crash, ["./launch.sh"])
    assert record["exit_code"] == signal_or_crash


def _race(url: str, workers: int, shard: int) -> list[int]:
    """Worker processes 1..n take over a dead claim at once: each lists the claims, then all create the next
    generation together. Each exits 0 if it won the shard, 1 if not."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(workers, timeout=60)

    class Together(Store):
        def files(self, rel_dir, suffix=""):
            listed = super().files(rel_dir, suffix)
            if rel_dir.startswith("claims/"):
                barrier.wait()  # nobody creates before everyone has listed: all try the same generation
            return listed

    def take(w: int) -> None:
        os._exit(0 if Claims(Together(url), w, f"run-{w}").try_claim(shard) else 1)

    locks = [RunLock(Store(url), w, f"run-{w}") for w in range(1, workers + 1)]
    for lock in locks:
        lock.acquire()  # the racers' runs are alive
    try:
        procs = [ctx.Process(target=take, args=(w,)) for w in range(1, workers + 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    finally:
        for lock in locks:
            lock.release()
    return sorted(p.exitcode for p in procs)


def _dead_claim(store: Store, shard: int) -> None:
    assert store.create_exclusive(f"claims/shard-{shard:05d}/g00000.json", b'{"worker": 0, "run_id": "dead"}')


def test_of_workers_taking_over_at_once_exactly_one_wins_on_disk(tmp_path):
    store = Store(tmp_path)
    _dead_claim(store, 5)
    assert _race(str(tmp_path), 3, 5) == [0, 1, 1]


def test_of_workers_taking_over_at_once_exactly_one_wins_on_an_object_store(store_env):
    url = f"{store_env[0]}://meshgen-test/race"
    _dead_claim(Store(url), 5)
    assert _race(url, 2, 5) == [0, 1]


def test_conditional_create_refuses_an_existing_key(store_env):
    store = Store(f"{store_env[0]}://meshgen-test/create")
    assert store.create_exclusive("x/y.json", b'{"a": 1}')
    assert not store.create_exclusive("x/y.json", b'{"a": 2}')
    assert store.read_json("x/y.json") == {"a": 1}
    barrier, wins = threading.Barrier(4, timeout=30), []

    def create(i: int) -> None:
        barrier.wait()
        if store.create_exclusive("x/z.json", str(i).encode()):
            wins.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(wins) == 1 and store.read_bytes("x/z.json") == str(wins[0]).encode()


def test_a_live_lock_on_an_object_store_refuses_a_second_run_of_the_same_worker(store_env):
    url = f"{store_env[0]}://meshgen-test/locked"
    with RunLock(Store(url), 0, "first"):
        with pytest.raises(LockHeld, match=r"workers.index=0.*pid \d+") as refused:
            RunLock(Store(url), 0, "second").acquire()
        assert refused.value.exit_code == 4
        with RunLock(Store(url), 1, "other-index"):  # other worker indexes never block each other
            pass
    with RunLock(Store(url), 0, "third"):  # released: the next run takes it at once
        pass


def test_a_live_object_store_lock_makes_a_launch_exit_4(store_env, tiny_model):
    scheme, env = store_env
    url = f"{scheme}://meshgen-test/locked-launch"
    with RunLock(Store(url), 0, "first"):
        res = launch(f"model.path={tiny_model}", f"output.dir={url}", env=env)
    assert res.returncode == 4, res.stderr[-2000:]
    assert "another run is active" in res.stderr and "workers.index=0" in res.stderr


def test_the_run_record_and_summary_lines_are_what_the_ledger_says(tmp_path):
    from launcher.host.summary import summarize

    store = Store(tmp_path)
    done = {"status": "done", "rows": 2, "run_id": "this-run"}
    with RunLock(store, 1, "other-run"):
        assert Claims(store, 1, "other-run").try_claim(4)  # held by another live run
        states = {
            0: {**done, "prompts_fingerprint": "fp0", "stages": {"denoise": 1.25, "encode": 0.5}, "truncated": 1},
            1: {**done, "prompts_fingerprint": "fp1", "stages": {"denoise": 0.75}, "truncated": 2},
            2: {"status": "failed", "rows": 0, "run_id": "this-run", "truncated": 5},
            5: {**done, "run_id": "old", "prompts_fingerprint": "fp5"},
            6: {**done, "run_id": "old", "prompts_fingerprint": "before"},  # its prompts changed; kept
        }
        for i, st in states.items():
            store.write_json(f"state/shard-{i:05d}.json", st)
        status = ["pending"] * 5 + ["done", "stale"]
        plan = Plan([ShardPlan(i, 2, f"fp{i}", status[i]) for i in range(7)], [0, 1, 2, 3, 4], [6])
        lines, record = summarize(store, Ledger(store), plan, "this-run", 0.0, 0, ["./launch.sh", "x=1"])
    assert {
        k: record[k]
        for k in record
        if k not in ("start", "end", "seconds", "images_per_s", "code", "versions", "metrics")
    } == {
        "run_id": "this-run",
        "exit_code": 3,
        "command": ["./launch.sh", "x=1"],
        "shards": 7,
        "selected": 5,
        "generated": 3,
        "failed_now": [2],
        "not_done": {"failed": [2], "pending": [3], "held_by_other_runs": [4]},
        "done": 3,
        "failed": 1,
        "pending": 2,
        "stale": 1,
        "images": 4,
        "stages": {"denoise": 2.0, "encode": 0.5},
        "truncated_prompts": 3,
        "startup_s": None,  # no state of this run says when its first shard started
    }
    assert record["images_per_s"] == round(4 / record["seconds"], 3) and record["seconds"] > 0
    metrics = record["metrics"]  # output.metrics's numbers: this run's shards 0, 1 (done) and 2 (failed)
    assert {k: metrics[k] for k in metrics if k not in ("images_per_second", "run_seconds")} == {
        "samples_done": 4,
        "samples_failed": 0,
        "shards_done": 2,
        "shards_failed": 1,
        "shard_seconds_count": 0,  # no state here says how long it took
        "shard_seconds_sum": 0,
        "shard_last_seconds": None,
        "stage_seconds": {"denoise": 2.0, "encode": 0.5},
    }
    assert [lines[0], lines[2], *lines[3:]] == [
        "shards: 3 done, 1 failed, 2 pending, 1 stale (kept)",
        "time per stage (s, summed over shards): denoise 2.0, encode 0.5",
        f"outputs: {store}",
        "3 prompts were longer than generate.max_sequence_length and were truncated",
        "shards [4] are being generated by other live workers",
        "not done: failed shards [2]; pending shards [3]; finish them with the same command: ./launch.sh x=1",
    ]
    assert lines[1].startswith("this run: 4 images from 3 shards in ")


def test_five_digit_shard_indices_read_back(tmp_path):
    from launcher.ledger.states import read_states

    store = Store(tmp_path)
    store.write_json("state/shard-12345.json", {"status": "done", "rows": 1})
    store.write_json("state/shard-00007.json", {"status": "failed", "rows": 0})
    assert sorted(read_states(store)) == [7, 12345]
    ledger = Ledger(store)
    ledger.refresh()
    ledger.refresh()
    assert ledger.reads == 2  # the second listing finds nothing new to read


# DESIGN.md, run.shards / run.stale / run.max_attempts: which shards a run generates, written out per status.
# 0 done, 1 pending, 2 failed, 3 failed but held back after run.max_attempts alike, 4 grown, 5 damaged, 6 stale.
STATUSES = {0: "done", 1: "pending", 2: "failed", 3: "failed", 4: "grown", 5: "damaged", 6: "stale"}
SELECTED = [
    ("pending", "keep", [1, 2, 4, 5]),  # all not done (a grown or damaged shard is not done); 3 held; stale kept
    ("pending", "regenerate", [1, 2, 4, 5, 6]),
    ("failed", "keep", [2, 3]),  # run.shards=failed retries a shard held back after its attempts too
    ("all", "keep", [0, 1, 2, 3, 4, 5, 6]),
    ("all", "error", [0, 1, 2, 3, 4, 5, 6]),  # all regenerates the stale ones: nothing to refuse
    ([6, 0], "keep", [6, 0]),  # a list is taken as given
]


@pytest.mark.parametrize(("shards", "stale", "expected"), SELECTED)
def test_which_shards_a_run_generates(shards, stale, expected):
    from launcher.ledger.states import select_shards

    assert select_shards(STATUSES, shards, stale, frozenset({3})) == expected


@pytest.mark.parametrize("shards", ["pending", "failed", [1]])
def test_done_shards_whose_prompts_changed_are_refused_by_default_naming_them(shards):
    from launcher.errors import ConfigError
    from launcher.ledger.states import select_shards

    with pytest.raises(ConfigError) as e:
        select_shards({0: "stale", 1: "pending", 2: "stale"}, shards)
    assert str(e.value) == (
        "shards [0, 2] are done but their prompts changed since; rerun with run.stale=regenerate to redo them, "
        "or run.stale=keep to keep the old images"
    )
    assert select_shards({0: "done", 1: "pending"}, "pending") == [1]  # nothing stale: nothing refused


def test_the_plan_by_row_judges_each_shard_against_its_state_and_the_listing(tmp_path, caplog):
    """DESIGN: done means verified (a done shard whose files are missing or of another size is damaged and made
    again by the same command); a grown source is not a change (a done shard that gained rows at its end is
    grown); a done shard whose prompts changed is stale. Shards of 3 rows over 11 prompts."""
    from launcher.config import load_config
    from launcher.plan.plan import make_plan

    src, out = tmp_path / "p.txt", Store(str(tmp_path / "out"))
    src.write_text("".join(f"prompt {i}\n" for i in range(8)))
    cfg = load_config("tiny", [f"dataset.path={src}", "run.shard_size=3", "run.stale=keep"])
    first = make_plan(cfg, {}, store=out)
    assert [(s.index, s.rows, s.status) for s in first.shards] == [
        (0, 3, "pending"),
        (1, 3, "pending"),
        (2, 2, "pending"),
    ]
    states = {}
    for s in first.shards:
        files = {f"data/shard-{s.index:05d}.parquet": [100 + s.index], f"images/shard-{s.index:05d}/": [s.rows, 40]}
        states[s.index] = {"status": "done", "rows": s.rows, "prompts_fingerprint": s.fingerprint, "files": files}
        out.write_bytes(f"data/shard-{s.index:05d}.parquet", b"x" * (100 + s.index))
        for k in range(s.rows):
            out.write_bytes(
                f"images/shard-{s.index:05d}/{k}.png", b"y" * (40 // s.rows if k else 40 - 40 // s.rows * (s.rows - 1))
            )
    assert make_plan(cfg, states, store=out).status == {0: "done", 1: "done", 2: "done"}

    (tmp_path / "out" / "data" / "shard-00001.parquet").unlink()  # shard 1's Parquet file is gone
    (tmp_path / "out" / "images" / "shard-00000" / "1.png").write_bytes(b"")  # shard 0's images changed size
    src.write_text("".join(f"prompt {i}\n" for i in range(11)))  # shard 2 grew by one row; shard 3 is new
    with caplog.at_level("WARNING"):
        plan = make_plan(cfg, states, store=out)
    assert plan.status == {0: "damaged", 1: "damaged", 2: "grown", 3: "pending"}
    again = "run.shards=pending generates it again"
    assert (
        f"{out}: shard 0 is damaged (images/shard-00000/ holds 3 files of 27 bytes, its state recorded 3 files of "
        f"40 bytes); {again}" in caplog.text
    )
    assert f"{out}: shard 1 is damaged (data/shard-00001.parquet is missing); {again}" in caplog.text
    assert plan.selected == [0, 1, 2, 3]
    assert make_plan(cfg, states).status == {0: "done", 1: "done", 2: "grown", 3: "pending"}  # no store: no listing

    src.write_text("".join(f"prompt {i}\n" for i in range(7)) + "an edited prompt\n")  # shard 2's 2nd row edited
    plan = make_plan(cfg, states, store=out)
    assert (plan.status[2], plan.stale, 2 in plan.selected) == ("stale", [2], False)  # run.stale=keep
    # DESIGN: run.stale's default refuses done shards whose prompts changed; run.shards=all makes every shard again,
    # so there is nothing to refuse.
    refusing = load_config("tiny", [f"dataset.path={src}", "run.shard_size=3"])
    with pytest.raises(ConfigError, match=r"^shards \[2\] are done but their prompts changed since"):
        make_plan(refusing, states, store=out)
    refusing.run.shards = "all"
    assert make_plan(refusing, states, store=out).selected == [0, 1, 2]
    limited = make_plan(load_config("tiny", [f"dataset.path={src}", "run.shard_size=3", "dataset.limit=4"]), states)
    assert [(s.index, s.rows, s.status) for s in limited.shards] == [(0, 3, "done"), (1, 1, "done")]


@pytest.mark.parametrize("ids", [True, False])
def test_a_row_column_the_pipeline_would_not_take_is_refused_naming_the_first_row_that_sets_it(tmp_path, ids):
    """DESIGN: a row column the family's pipeline does not take (negative_prompt on FLUX.2) is refused; a column
    empty throughout is no column. The refusal names the first id that sets it (ids default to the row number)."""
    from launcher.config import load_config
    from launcher.errors import ConfigError
    from launcher.plan.plan import make_plan
    from launcher.sources.prompts import SizeRule

    why = "FLUX.2 takes no negative prompt; remove the column"
    rule = SizeRule(16, 4 * 1024 * 1024, 64, 64, 10, (("negative_prompt", why),))
    src = tmp_path / "p.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"p {i}"} for i in range(5)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("tiny", [f"dataset.path={src}", "run.shard_size=2", *(["dataset.id_column=id"] if ids else [])])
    assert make_plan(cfg, {}, rule).status == {0: "pending", 1: "pending", 2: "pending"}
    rows[2]["negative_prompt"], rows[3]["negative_prompt"] = None, "blurry"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as e:
        make_plan(cfg, {}, rule)
    assert (
        str(e.value)
        == f"dataset {src}: column 'negative_prompt' is set (first at id {'r3' if ids else '3'!r}), but {why}"
    )
    assert make_plan(cfg, {}).status == {0: "pending", 1: "pending", 2: "pending"}  # no rule: nothing refused


def test_a_plan_file_holds_the_selected_shards_rows_with_their_kept_columns_and_refuses_a_source_changed_since(
    tmp_path,
):
    """Pass 2 (plans/<run id>.arrow): the selected shards' rows, each with its fingerprint and the kept source
    columns' types (DESIGN: source columns carried); a source edited between the plan and pass 2 is refused in one
    line naming the shard, never generated from rows the plan did not judge."""
    from launcher.config import load_config
    from launcher.errors import ConfigError
    from launcher.plan.plan import PlanFile, make_plan, write_plan_file

    src = tmp_path / "p.jsonl"
    rows = [{"prompt": f"p {i}", "topic": f"t{i}", "n": i} for i in range(7)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("tiny", [f"dataset.path={src}", "run.shard_size=3", "dataset.keep_columns=[topic,n]"])
    store = Store(str(tmp_path / "out"))
    done = make_plan(cfg, {})
    plan = make_plan(cfg, {1: {"status": "done", "rows": 3, "prompts_fingerprint": done.shards[1].fingerprint}})
    assert plan.selected == [0, 2]
    write_plan_file(store, "plans/r.arrow", cfg, plan)
    pf = PlanFile(store, "plans/r.arrow")
    assert pf.selected == [0, 2]
    for i, want in ((0, rows[:3]), (2, rows[6:])):
        shard = pf.shard(i)
        assert shard.fingerprint == plan.shards[i].fingerprint
        assert [(r["id"], r["prompt"], r["topic"], r["n"]) for r in shard.rows] == [
            (str(k + 3 * i), w["prompt"], w["topic"], w["n"]) for k, w in enumerate(want)
        ]
        assert [(f.name, f.type) for f in shard.kept] == [("topic", pa.string()), ("n", pa.int64())]
    rows[6]["prompt"] = "edited after the plan"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as e:
        write_plan_file(store, "plans/s.arrow", cfg, plan)
    assert str(e.value) == (
        f"the prompt source {src} changed while this run was planned (shard 2); "
        "run the same command again once it is complete"
    )
    assert not store.exists("plans/s.arrow")  # nothing half-written


def test_the_stale_refusal_names_up_to_five_changed_samples_references_and_a_likely_shift(monkeypatch):
    """launcher/plan/stale.py: the refusal of done shards whose prompts changed names up to 5 changed samples
    ("and N more", or "and more" where shards were not looked at), the changed reference images of an edit job, and,
    ids being row numbers, a change that looks like shifted rows with the fix (dataset.id_column)."""
    from launcher.config import load_config
    from launcher.plan import stale

    by_row, by_id = load_config("tiny", []), load_config("tiny", ["dataset.id_column=uid"])
    tail = "; rerun with run.stale=regenerate to redo them, or run.stale=keep to keep the old images"
    shift = (
        "; the prompts look shifted, as by a line inserted or deleted before them (ids are row numbers): "
        "set dataset.id_column to a column of stable ids so that done work keeps its ids"
    )
    seven = [f"s{i}" for i in range(7)]
    assert stale.stale_message(by_row, {2: (seven, False, [])}) == (
        f"shards [2] are done but their prompts changed since (samples s0, s1, s2, s3, s4 and 2 more){tail}"
    )
    assert stale.stale_message(by_row, {4: None, 1: (["a", "b"], True, [])}) == (
        f"shards [1, 4] are done but their prompts changed since (samples a, b and more){shift}{tail}"
    )
    assert stale.stale_message(by_id, {1: (["a", "b"], True, [])}) == (
        f"shards [1] are done but their prompts changed since (samples a, b){tail}"
    )
    refs = [f"r{i}.png" for i in range(6)]
    assert stale.stale_message(by_id, {0: (["e"], False, refs)}) == (
        "shards [0] are done but their reference images changed (r0.png, r1.png, r2.png, r3.png, r4.png and more) "
        f"since (samples e){tail}"
    )
    assert stale.stale_message(by_id, {0: None}) == f"shards [0] are done but their prompts changed since{tail}"
    # Only shards whose rows the plan kept are looked at; shards it did not keep count for nothing.
    monkeypatch.setattr(stale, "changed_ids", lambda store, i, table: ([f"x{i}"], False, []))
    with pytest.raises(ConfigError) as e:
        stale.refuse(by_row, None, [1, 2, 3, 4, 5, 6], {6: None})
    assert (
        str(e.value)
        == f"shards [1, 2, 3, 4, 5, 6] are done but their prompts changed since (samples x6 and more){tail}"
    )


def test_a_done_shard_whose_set_aside_row_is_fixed_has_grown_and_one_whose_row_changed_is_stale(tmp_path):
    """DESIGN, `dataset.bad_rows=skip`: a row set aside is generated once it is fixed, by the same command; its
    shard, done without it, has grown (made again, never refused as stale); a change to a row it was made with is
    stale (refused by run.stale's default). Shards of 2 rows by position, row 0 set aside (no prompt): the fixed
    row comes before the row the shard was made with, so this is not a shard that grew at its end."""
    from launcher.config import load_config
    from launcher.plan.plan import make_plan
    from launcher.sources import rejected

    src, out = tmp_path / "p.jsonl", Store(str(tmp_path / "out"))

    def source(prompts):
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    source([None, "b", "c", "d"])
    cfg = load_config("tiny", [f"dataset.path={src}", "dataset.bad_rows=skip", "run.shard_size=2"])
    first = make_plan(cfg, {}, store=out)
    assert [r["id"] for r in first.rejected] == ["0"] and [s.rows for s in first.shards] == [1, 2]
    rejected.write(out, "run-1", first.rejected)
    states = {}
    for s in first.shards:
        files = {f"data/shard-{s.index:05d}.parquet": [10]}
        states[s.index] = {"status": "done", "rows": s.rows, "prompts_fingerprint": s.fingerprint, "files": files}
        states[s.index]["run_id"] = "run-1"
        out.write_bytes(f"data/shard-{s.index:05d}.parquet", b"x" * 10)
    assert make_plan(cfg, states, store=out).status == {0: "done", 1: "done"}
    source(["a, fixed", "b", "c", "d"])
    plan = make_plan(cfg, states, store=out)
    assert (plan.status, plan.selected, plan.stale) == ({0: "grown", 1: "done"}, [0], [])
    # Which state each shard's plan read (a state written before attempts were recorded: by its run id): a claim
    # takes the shard only while its state is still that one (launcher/ledger/claims.py).
    assert [s.seen for s in plan.shards] == ["run-1", "run-1"]
    source([None, "b, changed", "c", "d"])
    with pytest.raises(ConfigError, match=r"^shards \[0\] are done but their prompts changed since"):
        make_plan(cfg, states, store=out)
