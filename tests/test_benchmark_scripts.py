"""Benchmark scripts write only what their run computed: no section of a part that did not run,
findings computed from the numbers, and the output files they actually wrote."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import smcdecode as sd

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    if str(ROOT / "benchmarks") not in sys.path:  # scripts import their sibling modules, as `python benchmarks/x.py` does
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ec():
    return _script("eval_constraints")


METHODS = ["unconstrained", "masked", "smc-1", "smc-4"]


def _output(text, valid, seconds=1.0, logp=-1.0):
    return {"text": text, "seconds": seconds, "parses": valid, "valid": valid, "ended": text is not None,
            "mean_ess": None, **({"logp_per_token": logp} if text is not None else {})}


def fake_report(ec, bench: bool, enumeration: bool) -> dict:
    """A tiny report as main() assembles it, with the parts that did not run left empty."""
    outputs = {
        "unconstrained": _output("Sure! Here is", False, 1.0, -0.5),
        "masked": _output('{"a": 1}', True, 1.0, -2.0),
        "smc-1": _output('{"a": 1}', True, 1.0, -2.0),
        "smc-4": _output('{"a": 2', False, 2.0, -1.5),  # returned, yet not valid: no "every output" claim
    }
    schemas = {"schemas": [{"subset": "Github_trivial", "id": "s1", "outputs": outputs}],
               "compile_errors": [], "sampled": 1} if bench else {"schemas": [], "compile_errors": [], "sampled": 0}
    rows = [{"problem": "toy regex", "support": 3, "tv_masked": 0.5, "tv_smc": {1: 0.49, 4: 0.2},
             "no_sample": {1: 0.1, 4: 0.0}, "replicates": 100, "tv_noise_floor": 0.01}] if enumeration else []
    args = {"per_subset": 1, "seed": 0, "max_schema_chars": 1500, "temperature": 0.7, "max_new_tokens": 8,
            "methods": METHODS, "skip_bench": not bench, "skip_enumeration": not enumeration}
    return {"date": "2000-01-01", "machine": "a test", "model": "toy", "args": args, "runtime_minutes": 0.1,
            "summary": ec.summarise(schemas, METHODS), "bench": schemas, "enumeration": rows}


def test_skipped_enumeration_leaves_no_enumeration_text(ec, tmp_path):
    out_json = tmp_path / "elsewhere.json"
    md = ec.markdown(fake_report(ec, bench=True, enumeration=False), out_json)
    assert "JSONSchemaBench" in md and "Findings" in md
    for unrun in ["Enumerable problems", "TV SMC", "noise floor", "particles remove", "global conditional"]:
        assert unrun not in md, unrun
    assert f"`{out_json}`" in md and "docs/evaluation.json" not in md


def test_skipped_bench_leaves_no_bench_text(ec, tmp_path):
    md = ec.markdown(fake_report(ec, bench=False, enumeration=True), tmp_path / "e.json")
    assert "Enumerable problems" in md and "TV SMC N=4" in md
    for unrun in ["JSONSchemaBench", "Valid outputs", "cannot compile", "masked decoding returned", "s/output"]:
        assert unrun not in md, unrun


def test_json_inside_the_repository_is_named_relative_to_it(ec):
    md = ec.markdown(fake_report(ec, bench=True, enumeration=True), ROOT / "docs" / "other.json")
    assert "Machine-readable: `docs/other.json`." in md


def test_findings_follow_the_numbers(ec, tmp_path):
    md = ec.markdown(fake_report(ec, bench=True, enumeration=True), tmp_path / "e.json")
    assert "Every output a constrained method returned" not in md  # smc-4 returned an invalid one
    assert "2 of the 3 outputs the constrained methods returned parsed and validated." in md
    assert "Valid outputs: masked decoding 100%, SMC N=1 100%, SMC N=4 0%." in md
    assert "SMC N=4 returned more valid outputs" not in md
    assert "returned the same output as masked decoding on 1 of the 1 schemas" in md
    assert "N=1 1.0x, N=4 2.0x" in md
    assert "its TV is within twice the noise floor of the masked column on 1 of 1 problems." in md
    assert "TV at N=4 is below TV at N=1 on 1 of 1 problems." in md
    assert "still more than three times the noise floor on 1 of 1 problems: toy regex 0.200 (masked 0.500)" in md


def test_render_only_names_the_json_it_rewrote(ec, tmp_path):
    report = fake_report(ec, bench=False, enumeration=True)
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    out_json.write_text(json.dumps(report, default=str))  # integer keys become strings, as on disk
    ec.main(["--render-only", "--out-json", str(out_json), "--out-md", str(out_md)])
    md = out_md.read_text()
    assert f"`{out_json}`" in md and "TV SMC N=4" in md and "JSONSchemaBench" not in md


def test_schemas_come_from_the_data_argument(ec, tmp_path):
    for subset in ec.SUBSETS:
        rows = [{"id": f"{subset}-{j}", "schema": {"type": "integer", "minimum": j}} for j in range(3)]
        (tmp_path / f"jsonschemabench_{subset}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = ec.sample_schemas(tmp_path, per_subset=2, max_chars=1500)
    assert [s for s, _, _ in got] == [s for s in ec.SUBSETS for _ in range(2)]
    assert all(sid.startswith(subset) for subset, sid, _ in got)


# -- structured_quality.py -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sq():
    return _script("structured_quality")


def _items(sq, tmp_path, per_subset=5):
    for subset in sq.SUBSETS:
        rows = [{"id": f"{subset}-{j}", "schema": {"type": "integer", "minimum": j}} for j in range(per_subset)]
        (tmp_path / f"jsonschemabench_{subset}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sq.load_items(tmp_path, None)


def test_shards_and_workers_split_the_schemas_exactly(sq, tmp_path):
    items = _items(sq, tmp_path)
    assert len(items) == 15 and len(sq.load_items(tmp_path, 2)) == 6
    seen = []
    for i in range(3):
        for j in range(2):
            seen += [it["k"] for it in sq.selected(items, (i, 3), (j, 2))]
    assert sorted(seen) == list(range(15))


def test_resume_skips_the_rows_already_written(sq, tmp_path):
    items = _items(sq, tmp_path)
    done = tmp_path / "done.jsonl"
    done.write_text(json.dumps({"subset": items[0]["subset"], "id": items[0]["id"], "method": "smc"}) + "\n\n")
    todo = sq.pending(items, ["smc", "masked"], sq.done_keys([done]))
    assert len(todo) == 29 and (items[0], "smc") not in todo and (items[0], "masked") in todo


def test_documents_are_checked_as_parse_checks_them(sq):
    from smcdecode.potentials.json_schema import check_schema

    v = check_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert sq.check_document(v, '{"a": 1}') == (True, True, "")
    parses, valid, why = sq.check_document(v, '{"a": 1, "a": 2}')
    assert parses and not valid and "repeats the key 'a'" in why
    assert sq.check_document(v, '{"a": "x"}')[:2] == (True, False)
    assert sq.check_document(v, '```json\n{"a": 1}```')[:2] == (False, False)
    assert sq.check_document(v, None) == (False, False, "no output")
    assert sq.check_document(None, "1")[:2] == (True, False)


def test_calls_respect_the_request_and_prompt_budgets(sq):
    work = [{"k": k, "ids": [0] * n} for k, n in enumerate([5, 50, 3, 40, 8, 200, 9])]
    batches = sq.calls(work, per_call=3, prompt_budget=60)
    assert sorted(it["k"] for b in batches for it in b) == list(range(7))
    assert all(len(b) <= 3 and (len(b) == 1 or sum(len(it["ids"]) for it in b) <= 60) for b in batches)
    assert [len(it["ids"]) for b in batches for it in b] == sorted(len(it["ids"]) for it in work)


def test_a_schema_that_does_not_compile_is_a_row_not_a_crash():
    qc = _script("quality_compile")
    model = sd.FunctionModel(lambda ctx: None, vocab=["a", "1", "<eos>"], eos="<eos>")
    c, info = qc.compile_constraint({"type": "integer", "minimum": 0, "maximum": 9}, model, 30.0, None)
    assert info["compiled"] and info["path"] == "automaton" and c.token_automaton is not None
    c, info = qc.compile_constraint({"not": {"type": "string"}}, model, 30.0, None)
    assert c is None and not info["compiled"] and "not" in info["reason"]
    c, info = qc.compile_constraint({"type": "integer"}, model, 1e-6, None)
    assert c is None and info["reason"] == "compile over 1e-06 s"


def test_an_automaton_compile_past_the_timeout_runs_on_llguidance(monkeypatch):
    """The timeout fires inside the regex library the automaton path calls (the library turns that
    library's errors into its own): the schema still compiles, on llguidance, and says why."""
    import time

    import interegular

    qc = _script("quality_compile")
    model = sd.FunctionModel(lambda ctx: None, vocab=["1", "2", "-", "<eos>"], eos="<eos>")
    parse = interegular.parse_pattern

    def slow(pattern):
        time.sleep(5)
        return parse(pattern)

    monkeypatch.setattr(interegular, "parse_pattern", slow)
    c, info = qc.compile_constraint({"type": "integer"}, model, 0.5, None)
    assert info["compiled"] and info["path"] == "llguidance" and c.path == "llguidance"
    assert info["reason"] == "automaton compile over 0.5 s: llguidance"


def test_a_timeout_that_a_library_turns_into_another_error_still_counts_as_a_timeout(monkeypatch):
    """numpy turns an exception raised inside its comparisons into a TypeError: the alarm still counts."""
    import time

    from smcdecode.potentials import automaton

    qc = _script("quality_compile")
    model = sd.FunctionModel(lambda ctx: None, vocab=["1", "2", "-", "<eos>"], eos="<eos>")

    def slow(*args):
        try:
            time.sleep(5)
        except BaseException:
            raise TypeError("Cannot compare structured arrays unless they have a common dtype") from None

    monkeypatch.setattr(automaton, "minimal_bytes", slow)
    c, info = qc.compile_constraint({"type": "integer"}, model, 0.5, None)
    assert info["compiled"] and info["path"] == "llguidance" and c.path == "llguidance"
    assert info["reason"] == "automaton compile over 0.5 s: llguidance"
    c, info = qc.compile_constraint({"not": {"type": "string"}}, model, 30.0, None)  # (the flag is cleared)
    assert c is None and "not" in info["reason"]


def test_a_row_gives_the_path_of_the_bound_constraint(monkeypatch):
    """A token automaton too large falls back to llguidance at binding: the row says so."""
    from smcdecode.potentials import automaton

    qc = _script("quality_compile")
    model = sd.FunctionModel(lambda ctx: None, vocab=["1", "2", "-", "<eos>"], eos="<eos>")
    monkeypatch.setattr(automaton, "MAX_STATES", 1)
    c, info = qc.compile_constraint({"type": "integer", "minimum": 0, "maximum": 99}, model, 30.0, None)
    assert info["compiled"] and c.path == info["path"] == "llguidance" and "more than 1 states" in info["reason"]


def test_a_compiled_constraint_crosses_processes_and_masks_the_same():
    import pickle

    import torch

    qc = _script("quality_compile")
    model = sd.FunctionModel(lambda ctx: None, vocab=["a", "1", "2", "<eos>"], eos="<eos>")
    c, info = qc.compile_constraint({"type": "integer", "minimum": 0, "maximum": 29}, model, 30.0, None)
    assert info["path"] == "automaton"
    back = qc.restore(pickle.loads(pickle.dumps(qc.portable(c))), model)
    assert back.model is model and back.path == "automaton"
    assert torch.equal(back.token_automaton.table, c.token_automaton.table)
    state = back.start(1)
    assert torch.equal(back.allowed_bits(state), c.allowed_bits(c.start(1)))
    assert qc.restore(None, model) is None
    # on the superset path (its character automaton stays in the process, its token automaton crosses)
    vocab = ["{", "}", '"', "a", ":", " ", "1", "<eos>"]
    model = sd.FunctionModel(lambda ctx: None, vocab=vocab, eos="<eos>")
    c, info = qc.compile_constraint({"type": "object", "additionalProperties": {"type": "integer"}}, model, 30.0, None)
    assert info["path"] == "superset", info
    back = qc.restore(pickle.loads(pickle.dumps(qc.portable(c))), model)
    assert back.path == "superset" and torch.equal(back.superset_automaton.table, c.superset_automaton.table)
    assert torch.equal(back.allowed_bits(back.start(1)), c.allowed_bits(c.start(1)))
    # on the llguidance path (its tokenizer and lanes stay in the process; restore compiles them again)
    model = sd.FunctionModel(lambda ctx: None, vocab=["{", "}", '"', "a", ":", " ", "1", "<eos>"], eos="<eos>")
    c, info = qc.compile_constraint({"type": "object", "minProperties": 1}, model, 30.0, None)
    assert info["path"] == "llguidance"
    back = qc.restore(pickle.loads(pickle.dumps(qc.portable(c))), model)
    assert back.path == "llguidance"
    state, ref = back.start(1), c.start(1)
    for t in (0, 2, 3, 2, 4, 5, 6):  # {"a": 1
        assert torch.equal(back.allowed_bits(state), c.allowed_bits(ref))
        state, ref = back.advance(state, torch.tensor([t])), c.advance(ref, torch.tensor([t]))
    assert torch.equal(back.allowed_bits(state), c.allowed_bits(ref)) and back.allowed(state)[0, 1]


def test_the_plan_runs_every_method_on_a_group_before_the_next(sq, tmp_path):
    items = _items(sq, tmp_path)
    for it in items:
        it["ids"] = [0] * (2 + it["k"] % 4)
    todo = sq.pending(items, ["smc", "masked", "unconstrained"], set())
    steps = sq.plan(todo, ["smc", "masked", "unconstrained"], 4, {"smc": 2, "masked": 8, "unconstrained": 8}, 10**6, 0)
    groups = [g for _, _, g in steps]
    assert groups == sorted(groups) and len(set(groups)) == 4
    for g in set(groups):  # each method gets the same schemas of a group, the methods in order
        per = {m: sorted(it["k"] for mm, b, gg in steps if gg == g and mm == m for it in b)
               for m in ("smc", "masked", "unconstrained")}
        assert per["smc"] == per["masked"] == per["unconstrained"] and len(per["smc"]) in (3, 4)
        order = [("smc", "masked", "unconstrained").index(m) for m, _, gg in steps if gg == g]
        assert order == sorted(order)
    assert sorted(it["k"] for m, b, _ in steps if m == "smc" for it in b) == list(range(15))


def test_quality_summary_counts_what_the_rows_say(sq, tmp_path):
    def row(sid, method, valid, compiled=True, path="automaton", ll=-1.0, s=2.0):
        return {"subset": "Glaiveai2K", "id": sid, "method": method, "compiled": compiled, "path": path,
                "valid": valid, "parses": valid, "text": "{}" if ll is not None else None, "loglik_per_token": ll,
                "seconds": s, "device": "test", "reason": "why" if not compiled else "regular"}
    rows = [row("a", "smc", False), row("a", "smc", True, ll=-3.0),  # written again: the later row counts
            row("b", "smc", False, compiled=False, path=None, ll=None, s=None),
            row("a", "unconstrained", False, compiled=None, path=None, ll=-0.5, s=1.0),
            row("b", "unconstrained", False, compiled=None, path=None, ll=-0.5, s=1.0),
            row("c", "smc", True)]  # no unconstrained row: left out of the comparison, counted in the coverage
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "summary.json"
    sq.main(["--summarise", str(f), "--summary-out", str(out)])
    s = json.loads(out.read_text())
    smc = s["subsets"]["Glaiveai2K"]["smc"]
    assert (smc["schemas"], smc["compiled"], smc["automaton"], smc["valid"], smc["valid_of_compiled"]) == (2, 1, 1, 0.5, 1.0)
    assert smc["loglik_per_token"] == -3.0 and smc["seconds_mean"] == 2.0 and smc["no_output"] == 1
    assert s["subsets"]["all"]["unconstrained"]["compiled"] is None
    assert s["not_compiled"] == {"why": 1} and "masked" not in s["subsets"]["all"]
    assert "Github_easy" in s["subsets"] and s["subsets"]["Github_easy"] == {}
    cov = s["coverage"]
    assert cov["methods"]["smc"]["all"] == 3 and cov["methods"]["unconstrained"]["all"] == 2
    assert cov["all_methods"]["Glaiveai2K"] == 2




def test_structured_engine_only_runs_the_rows_named_and_refuses_unknown_labels(monkeypatch, tmp_path):
    """``structured_engine.py --only``: an unknown label stops the script with the labels it knows
    (before any model loads); known ones leave only those schemas' rows, on each path they run."""
    import types

    se = _script("structured_engine")
    monkeypatch.setattr(sys, "argv", ["structured_engine.py", "--tiny", "--only", "contact,nope"])
    with pytest.raises(SystemExit, match="'nope' not among the schemas' labels 'small object', 'contact'"):
        se.main()
    seen = []
    monkeypatch.setattr(se, "random_models", lambda args, device, dtype: ("stub", None, None, None, [[1, 2, 3]], 0))
    monkeypatch.setattr(se, "Engine", lambda target, draft, config: types.SimpleNamespace(config=config))
    monkeypatch.setattr(se, "run_model", lambda name, engine, model, prompts, eos, schemas, args, device:
                        seen.append([(lab, path, held) for lab, _, path, held in schemas]) or [])
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["structured_engine.py", "--tiny", "--only", "contact,tree", "--models", "random",
                                      "--out", str(out)])
    se.main()
    assert seen == [[("contact", "auto", True), ("contact", "llguidance", True), ("contact", "llguidance", False),
                     ("tree", "auto", True)]]
    assert json.loads(out.read_text())["rows"] == []


def test_structured_engine_reads_the_hosts_load_from_proc_stat():
    """``cpu_share``: the busy and stolen shares of all CPUs' time between two readings of /proc/stat
    (idle and iowait are not busy; steal is another tenant's); None where /proc/stat cannot be read."""
    se = _script("structured_engine")
    share = se.cpu_share([100, 0, 50, 800, 50, 0, 0, 0], [200, 0, 100, 1000, 50, 0, 0, 50])
    assert share == {"cpu_busy": pytest.approx(0.5), "cpu_steal": pytest.approx(0.125)}
    assert se.cpu_share(None, [1] * 8) == {"cpu_busy": None, "cpu_steal": None}
    if Path("/proc/stat").exists():
        now = se.cpu_times()
        assert len(now) == 8 and all(x >= 0 for x in now)
    assert se.host_probe(repeats=3) > 0


def _burn(stop) -> None:
    while not stop.is_set():
        sum(range(1000))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_structured_engine_reads_its_children_cpu_time():
    """``children_cpu``: a child that computes for a while shows CPU time; one that has ended is
    not listed."""
    import multiprocessing
    import time

    se = _script("structured_engine")
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    child = ctx.Process(target=_burn, args=(stop,))
    child.start()
    try:
        time.sleep(0.5)
        used = se.children_cpu()
        assert used[child.pid] > 0.1
    finally:
        stop.set()
        child.join(10)
    assert child.pid not in se.children_cpu()


def test_structured_engine_counts_its_page_faults():
    """``own_counters`` / ``counters_per_call``: touching fresh memory shows as minor page faults,
    divided over the calls."""
    import mmap

    se = _script("structured_engine")
    before = se.own_counters()
    m = mmap.mmap(-1, 64 * mmap.PAGESIZE)
    for i in range(64):
        m[i * mmap.PAGESIZE] = 1
    m.close()
    per = se.counters_per_call(before, se.own_counters(), 2)
    assert per["main_faults_per_call"] >= 32 - 1e-9
    assert per["main_switches_per_call"]["voluntary"] >= 0 and per["main_switches_per_call"]["involuntary"] >= 0
    assert se.counters_per_call((0, 2, 4), (10, 6, 8), 2) == {
        "main_faults_per_call": 5.0, "main_switches_per_call": {"voluntary": 2.0, "involuntary": 2.0}}
