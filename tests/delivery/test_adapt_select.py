"""The adaptation a bundle serves is chosen on validation users and never worse than not adapting.

Real tiny data: generated rows split by user (meta_io.holdout), a meta-mode train-local run on the
training users, delivered with the held-out users as the gate's holdout (first-k, K = 8).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from delivery.adapt import AdaptingModel, Recipe
from delivery.adapt_select import (
    Scored, choose, not_selected, score_recipes, select_recipe, validation_episodes,
)
from delivery.bundle import DeliveryError, read_manifest
from delivery.gate import run_gate
from delivery.loader import load_bundle
from delivery.predict import predict_to_parquet
from meta_io.firstk import first_k_layout, read_table
from common.evaluation import auc
from metaps.cli import main
from tests.progress_hooks import Recorder, check_stage

K = 8


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Train on 70% of the users, deliver with the other 30% as the holdout."""
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.holdout import split_by_task
    from meta_io.schema import load_schema
    from meta_io.synth import GeneratorConfig, generate
    from tests.workers.conftest import make_job
    from workers.local import train_local

    root = tmp_path_factory.mktemp("adapt-select")
    gen = generate(root / "raw", GeneratorConfig(rows=4000, users=300, items=200, seed=3, n_files=1,
                                                 row_group_rows=4000), progress=False)
    split = split_by_task(gen.out_dir, load_schema(gen.schema_path), root / "split", fraction=0.3, seed=0)
    meta = build(split.train_dir, split.schema_path, root / "meta",
                 MetaIOBuildConfig(support=4, query=4, rows_per_batch=64)).out_dir
    job = make_job(meta, root, meta={"inner_steps": 1, "inner_lr": 0.1}, train={"max_steps": 40})
    _, local = train_local(job, root / "local", checkpoint=False)
    ckpt = local.checkpoint()
    # the real CLI, off a terminal (its progress and log lines on stderr), counting the holdout's data reads
    # through pyarrow's own Parquet reader
    reads: list[int] = []
    iter_batches = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        reads.append(1)
        return iter_batches(self, *args, **kwargs)

    from metaps.progress import StageProgress

    told: list[tuple[str, int, int]] = []  # what the CLI's progress hook was told (and drew)
    draw = StageProgress.__call__

    def hook(self, stage, done, total):
        told.append((str(stage), done, total))
        return draw(self, stage, done, total)

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setattr(pq.ParquetFile, "iter_batches", counted)
        mp.setattr(StageProgress, "__call__", hook)
        assert main(["deliver", "--checkpoint", str(ckpt), "--out", str(root / "bundles"),
                     "--holdout", str(split.holdout_dir), "--no-progress"]) == 0
    return {"root": root, "bundle": root / "bundles" / "v000001", "holdout": split.holdout_dir, "ckpt": ckpt,
            "stdout": out.getvalue(), "stderr": err.getvalue(), "reads": len(reads), "told": told}


def _by_kind(rec: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for c in rec["candidates"]:
        out.setdefault(c["recipe"]["kind"], []).append(c)
    return out


def test_the_choice_is_never_worse_than_no_adaptation_on_validation(world) -> None:
    rec = read_manifest(world["bundle"]).gate["adapt"]
    assert rec["selected"] and rec["protocol"] == "first-k" and rec["k"] == K and rec["tasks"] > 20
    kinds = _by_kind(rec)
    assert set(kinds) == {"none", "offset", "inner", "inner+offset"}
    assert len(kinds["offset"]) == 3 and len(kinds["inner"]) == 3  # priors 1/4/16, rates x0.1/0.3/1
    # each inner rate + an offset at each prior: the prior is chosen with the rate, not fixed at 16
    assert sorted((c["recipe"]["inner_lr"], c["recipe"]["offset_prior"]) for c in kinds["inner+offset"]) == sorted(
        (c["recipe"]["inner_lr"], p) for c in kinds["inner"] for p in (1.0, 4.0, 16.0))
    none = kinds["none"][0]["mean_auc"]
    chosen = next(c for c in rec["candidates"] if c["recipe"] == rec["choice"])
    best = max(c["mean_auc"] for c in rec["candidates"])
    assert chosen["mean_auc"] >= none
    assert chosen["mean_auc"] >= best - 1e-4
    # the configured recipe (1 step at 0.1) is a candidate; on this data it is worse than none, so
    # shipping it unchosen would have lowered the validation AUC
    conf = next(c for c in rec["candidates"] if c["recipe"] == rec["configured"])
    assert rec["configured"]["inner_steps"] == 1 and rec["configured"]["inner_lr"] == 0.1
    assert conf["mean_auc"] < chosen["mean_auc"]
    assert rec["choice"] != rec["configured"]
    assert "adaptation chosen on" in world["stdout"]


def _lines(stderr: str, msg: str) -> list[dict]:
    from metaps.progress import parse_kv_line

    return [rec for line in stderr.splitlines() if f'msg="{msg}"' in line and (rec := parse_kv_line(line)) is not None]


def test_the_gate_reads_the_holdout_once_and_tells_each_candidate(world) -> None:
    """One data read per holdout file for the whole delivery (the AUC comparison and the first-k episodes
    share it); a stderr line per adaptation candidate as it is scored (name, score, candidates left)."""
    from meta_io.source import list_source_files

    files = list_source_files(world["holdout"])
    assert len(files) >= 1 and world["reads"] == len(files), (world["reads"], files)
    rec = read_manifest(world["bundle"]).gate["adapt"]
    lines = _lines(world["stderr"], "adaptation candidate scored")
    n = len(rec["candidates"])
    by_name = {c["name"]: c for c in rec["candidates"]}
    # each inner loop's candidates come together (its "+ offset" twin right after it)
    assert n == 16 and sorted(x["candidate"] for x in lines) == sorted(by_name), world["stderr"]
    assert [int(x["left"]) for x in lines] == list(range(n - 1, -1, -1))
    assert [x["done"] for x in lines] == [f"{i}/{n}" for i in range(1, n + 1)]
    assert [float(x["mean_auc"]) for x in lines] == [round(by_name[x["candidate"]]["mean_auc"], 5) for x in lines]
    # the gate stage's progress counts the candidates: consistency, the AUC, 16 candidates, the comparison
    steps = [(d, t) for stage, d, t in world["told"] if stage == "gate"]
    check_stage(steps, n + 3)
    assert sorted({d for d, _ in steps}) == list(range(n + 4)), steps
    gate = [x for x in _lines(world["stderr"], "progress") if x["what"] == "gate"]
    assert gate and int(gate[-1]["done"]) == int(gate[-1]["total"]) == n + 3, world["stderr"]


def test_the_shared_scoring_equals_one_adaptation_per_candidate(world) -> None:
    """The choice and every candidate's AUC equal the per-candidate computation the gate ran before the
    inner loops were shared (each recipe adapted and scored on its own through ``AdaptingModel.recipe_probs``,
    its own lookups; "+ offset" re-adapting and fitting its offset inside ``adapt_and_predict``): the gate's
    post-hoc offsets on :func:`models.meta.adapt_tasks`' shared logits are what serving computes."""
    rec = read_manifest(world["bundle"]).gate["adapt"]
    recipes = [Recipe.from_dict(c["recipe"], "test") for c in rec["candidates"]]
    served = load_bundle(world["bundle"])
    try:
        adapting = AdaptingModel(served)
        _, batches = validation_episodes(world["holdout"], served.schema, K)
        heads = [h.name for h in adapting.model.heads]
        scores: list[dict[str, list[np.ndarray]]] = [{h: [] for h in heads} for _ in recipes]
        y: dict[str, list[np.ndarray]] = {h: [] for h in heads}
        for mb in batches:
            real = mb.query.mask.bool()
            if not bool(real.any()):
                continue
            uniq, rows = adapting.rows_for([mb.support, mb.query])
            for h in adapting.model.heads:
                y[h.name].append(h.target(mb.query)[real].numpy().astype(np.float64))
            for i, r in enumerate(recipes):
                probs = adapting.recipe_probs(r, mb.support, mb.query, uniq, rows)
                for h in heads:
                    scores[i][h].append(probs[h][real].detach().numpy().astype(np.float64))
    finally:
        served.close()
    target = {h: np.concatenate(v) for h, v in y.items()}
    old = []
    for r, per in zip(recipes, scores):
        a = {h: float(auc(target[h], np.concatenate(v))) for h, v in per.items()}
        defined = [v for v in a.values() if not math.isnan(v)]
        old.append(Scored(r, a, float(np.mean(defined)) if defined else math.nan))
    assert [c["auc"] for c in rec["candidates"]] == [s.auc for s in old]  # exact, every head of every candidate
    assert [c["mean_auc"] for c in rec["candidates"]] == [s.mean_auc for s in old]
    assert rec["choice"] == choose(old).recipe.to_dict()
    assert len({round(s.mean_auc, 6) for s in old}) > 5  # the candidates differ: equality is not trivial


def test_a_harmful_recipe_loses_to_no_adaptation(world, capsys) -> None:
    harmful = Recipe(1, 1000.0)
    served = load_bundle(world["bundle"])
    try:
        _, batches = validation_episodes(world["holdout"], served.schema, K)
        scored, tasks, rows = score_recipes(AdaptingModel(served), batches, [Recipe(0, 0.1), harmful])
        assert tasks > 20 and rows > 200
        none, bad = scored
        assert bad.mean_auc < none.mean_auc - 0.01, (none, bad)
        assert choose(scored).recipe == Recipe(0, 0.1)
        # its inner step raised the support loss on most validation episodes: counted, not hidden
        assert (none.diverged, none.adapted) == (0, 0) and bad.adapted == tasks and bad.diverged_share > 0.5, bad
        # among the whole candidate set too
        sel = select_recipe(served, world["holdout"], K, extra=[harmful])
        assert harmful in [s.recipe for s in sel.candidates] and sel.chosen != harmful
        assert next(s for s in sel.candidates if s.recipe == sel.chosen).mean_auc >= sel.base().mean_auc
        # the record and the summary name the diverging loop (once for it and its "+ offset" twins, if any);
        # the candidate set's own rates did not diverge here
        rec = sel.record()
        line = f"inner(1x1000): inner step raised the support loss on {round(100 * bad.diverged_share)}% of {tasks} " \
               f"validation episodes"
        assert rec["diverged"] == [line] and line in sel.summary()
        by = {c["name"]: c for c in rec["candidates"]}
        assert by["inner(1x1000)"]["inner_diverged"] == {"episodes": tasks, "diverged": bad.diverged,
                                                         "share": bad.diverged_share}
        assert all(c["inner_diverged"]["diverged"] == 0 for n, c in by.items() if n != "inner(1x1000)" and
                   c["recipe"]["inner_steps"]), by
        assert all("inner_diverged" not in c for c in rec["candidates"] if not c["recipe"]["inner_steps"])
    finally:
        served.close()
    # metaps evaluate counts the same episodes, names them on stderr and in its report
    capsys.readouterr()
    assert main(["evaluate", "--bundle", str(world["bundle"]), "--data", str(world["holdout"]), "--protocol",
                 "first-k", "--k", str(K), "--no-progress", *harmful.evaluate_args()]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    assert report["inner_diverged"] == {"episodes": tasks, "diverged": bad.diverged, "share": bad.diverged_share}
    assert f"inner step raised the support loss on {round(100 * bad.diverged_share)}% of {tasks} episodes" in err


def test_ties_go_to_the_simpler_recipe_and_nan_loses() -> None:
    none, off, inner = Recipe(0, 0.1), Recipe(0, 0.1, 4, 4.0), Recipe(1, 0.1)
    assert choose([Scored(none, {}, 0.7), Scored(off, {}, 0.7), Scored(inner, {}, 0.7)]).recipe == none
    assert choose([Scored(inner, {}, 0.70005), Scored(off, {}, 0.7)]).recipe == off  # within the tie tolerance
    assert choose([Scored(none, {}, 0.7), Scored(inner, {}, 0.71)]).recipe == inner
    assert choose([Scored(none, {}, math.nan), Scored(inner, {}, 0.6)]).recipe == inner
    # equally simple and tied: the loop that diverged on fewer episodes wins, whatever the order
    wild, calm = Scored(Recipe(1, 1.0), {}, 0.70005, diverged=30, adapted=100), Scored(inner, {}, 0.7, 0, 100)
    assert choose([wild, calm]).recipe == inner and choose([calm, wild]).recipe == inner
    assert choose([Scored(Recipe(1, 1.0), {}, 0.72, 30, 100), calm]).recipe == Recipe(1, 1.0)  # AUC still judges
    with pytest.raises(DeliveryError, match="no candidate has a validation AUC"):
        choose([Scored(none, {}, math.nan)])


def _support_and_query(world, tmp: Path) -> tuple[Path, Path]:
    """The holdout's first-k support rows (first K per user by time) and later rows, as two Parquet files."""
    served = load_bundle(world["bundle"])
    schema = served.schema
    served.close()
    from meta_io.source import list_source_files

    # the raw holdout files in the order the protocol reads them (read_table's rows are normalized: padded lists)
    table = pa.concat_tables([pq.read_table(f) for f in list_source_files(world["holdout"])])
    assert table.num_rows == read_table(world["holdout"], schema).num_rows
    lay = first_k_layout(table.column(schema.task_key).to_numpy(), table.column(schema.timestamp).to_numpy(), K)
    sup, qry = tmp / "support.parquet", tmp / "query.parquet"
    pq.write_table(table.take(pa.array(lay.support.reshape(-1))), sup)
    pq.write_table(table.take(pa.array(lay.query_rows)), qry)
    return sup, qry


def test_the_bundle_carries_the_choice_and_predict_support_applies_it(world, tmp_path) -> None:
    rec = read_manifest(world["bundle"]).gate["adapt"]
    choice = Recipe.from_dict(rec["choice"], "test")
    served = load_bundle(world["bundle"])
    try:
        adapting = AdaptingModel(served)
        assert adapting.recipe == choice and adapting.recipe_from == "gate"
    finally:
        served.close()
    # the same bundle without the gate's choice serves the configured recipe
    plain = tmp_path / "configured" / "v000001"
    shutil.copytree(world["bundle"], plain)
    man = json.loads((plain / "manifest.json").read_text())
    del man["gate"]["adapt"]
    (plain / "manifest.json").write_text(json.dumps(man))
    served = load_bundle(plain)
    try:
        assert AdaptingModel(served).recipe == Recipe(1, 0.1) and AdaptingModel(served).recipe_from == "configured"
    finally:
        served.close()

    sup, qry = _support_and_query(world, tmp_path)
    chosen = predict_to_parquet(world["bundle"], qry, tmp_path / "chosen.parquet", support=sup)
    configured = predict_to_parquet(plain, qry, tmp_path / "conf.parquet", support=sup)
    assert chosen.adapted and chosen.rows > 200
    assert (chosen.recipe, chosen.recipe_from) == (choice.name, "gate")
    assert (configured.recipe, configured.recipe_from) == ("inner(1x0.1)", "configured")
    a = pq.read_table(tmp_path / "chosen.parquet").column("p_click").to_numpy()
    b = pq.read_table(tmp_path / "conf.parquet").column("p_click").to_numpy()
    assert np.abs(a - b).max() > 1e-3
    # predict --support reproduces the validation figures of the choice and of the configured recipe (the
    # streaming AUC and float32 sums differ from the selection's exact AUC in the 5th decimal)
    conf = next(c for c in rec["candidates"] if c["recipe"] == rec["configured"])
    for h in ("click", "conversion"):
        assert chosen.auc[h] == pytest.approx(rec["choice_auc"][h], abs=2e-4), h
        assert configured.auc[h] == pytest.approx(conf["auc"][h], abs=2e-4), h


def test_offset_only_adds_each_tasks_newton_offset_to_the_base_logit(world) -> None:
    from models.meta_offset import fit_offsets

    served = load_bundle(world["bundle"])
    try:
        adapting = AdaptingModel(served)
        _, batches = validation_episodes(world["holdout"], served.schema, K, tasks_per_batch=8)
        mb = next(batches)
        uniq, rows = adapting.rows_for([mb.support, mb.query])
        got = adapting.recipe_probs(Recipe(0, 0.1, 3, 4.0), mb.support, mb.query, uniq, rows)
        base = adapting.recipe_probs(Recipe(0, 0.1), mb.support, mb.query, uniq, rows)
        with torch.no_grad():
            zs, zq = adapting.model(mb.support, rows, uniq), adapting.model(mb.query, rows, uniq)
        for t in range(mb.support.mask.shape[0]):  # the reference: one task at a time
            one = mb.support.map(lambda x: x[t])
            b = fit_offsets({h: z[t] for h, z in zs.items()}, one, adapting.model.heads, 3, 4.0)
            for h in got:
                want = torch.sigmoid(zq[h][t] + b[h])
                torch.testing.assert_close(got[h][t], want, atol=1e-6, rtol=0)
                torch.testing.assert_close(base[h][t], torch.sigmoid(zq[h][t]), atol=1e-6, rtol=0)
        assert any(float((got[h] - base[h]).abs().max()) > 1e-3 for h in got)
    finally:
        served.close()


def test_without_a_holdout_the_configured_recipe_ships_and_the_report_says_so(world) -> None:
    report = run_gate(world["bundle"])
    assert report.ok and report.adapt["selected"] is False
    assert report.adapt["reason"] == "no holdout to validate on"
    assert report.adapt["configured"]["inner_lr"] == 0.1 and "choice" not in report.adapt
    assert "the configured recipe ships" in report.adapt_summary
    sel = not_selected(read_manifest(world["bundle"]), "why")
    assert sel.chosen == Recipe(1, 0.1) and sel.summary().startswith("adaptation not selected (why)")


def test_a_holdout_without_episodes_ships_the_configured_recipe(world) -> None:
    """No holdout user has more than k rows: no episode to validate on; the gate passes and says why."""
    rec = Recorder()
    report = run_gate(world["bundle"], holdout=str(world["holdout"]), adapt_k=100_000, progress=rec)
    assert report.ok and report.auc and report.adapt["selected"] is False
    # the gate's steps: consistency, the AUC, (no candidate could be scored), the published comparison
    check_stage(rec.of("gate"), 19)
    assert [d for d, _ in rec.of("gate")] == [0, 1, 2, 18, 19]
    assert "no validation episode" in report.adapt["reason"]
    assert report.record(str(world["holdout"]))["adapt"] == report.adapt


def test_a_meta_io_holdout_is_validated_on_its_episodes(world, tmp_path) -> None:
    """A Meta-IO meta-layout holdout gives its own episodes; a plain layout has none (named)."""
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.layout import Layout

    schema = world["holdout"].parent / "schema.json"
    meta = build(world["holdout"], schema, tmp_path / "meta", MetaIOBuildConfig(support=4, query=4, rows_per_batch=512)).out_dir
    plain = build(world["holdout"], schema, tmp_path / "plain", MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=128)).out_dir
    served = load_bundle(world["bundle"])
    try:
        told: list[tuple[str, int, int]] = []
        sel = select_recipe(served, meta, K, max_rows=400, on_scored=lambda s, d, n: told.append((s.recipe.name, d, n)))
        assert sel.selected and sel.protocol == "episodes" and sel.k == 0 and sel.tasks > 20
        n = len(sel.candidates)  # told as each candidate is done, with its own figures
        assert [(d, t) for _, d, t in told] == [(i, n) for i in range(1, n + 1)]
        assert sorted(name for name, _, _ in told) == sorted(s.recipe.name for s in sel.candidates)
        assert next(s for s in sel.candidates if s.recipe == sel.chosen).mean_auc >= sel.base().mean_auc
        with pytest.raises(DeliveryError, match="plain-layout Meta-IO holdout has no support/query episodes"):
            select_recipe(served, plain, K)
    finally:
        served.close()


def test_the_candidates_pair_every_inner_rate_with_every_offset_prior() -> None:
    """none, an offset alone at priors 1/4/16, each inner rate alone and + an offset at each prior; the
    configured prior joins the priors; learned rates try the configured rate only."""
    from delivery.adapt_select import candidate_recipes

    got = candidate_recipes(Recipe(1, 0.1))
    rates = (0.1 * 0.1, 0.1 * 0.3, 0.1)
    assert got == ([Recipe(0, 0.1)] + [Recipe(0, 0.1, 4, p) for p in (1.0, 4.0, 16.0)]
                   + [Recipe(1, r) for r in rates] + [Recipe(1, r, 4, p) for r in rates for p in (1.0, 4.0, 16.0)])
    conf = Recipe(2, 0.05, 3, 2.0)  # its offset's steps and prior join the candidates
    got = candidate_recipes(conf)
    assert len(got) == 1 + 4 + 3 + 12 and conf in got
    assert {r.offset_prior for r in got if r.offset_steps} == {1.0, 2.0, 4.0, 16.0}
    assert {r.offset_steps for r in got if r.offset_steps} == {3}
    learned = candidate_recipes(Recipe(1, 0.1), learned_rates=True)
    assert [r.name for r in learned if r.inner_steps] == ["inner(1x0.1)"] + [f"inner(1x0.1)+offset(4, prior {p})"
                                                                           for p in (1, 4, 16)]


def test_every_candidate_is_a_metaps_evaluate_recipe_with_the_same_auc(world, capsys) -> None:
    """Every recipe the gate can serve (the offset alone included) is one ``metaps evaluate`` scores: each
    candidate's ``Recipe.evaluate_args`` parse to the recipe the gate ran (``Recipe.meta``), and through the
    real CLI one candidate per inner loop (every kind, rate and prior among them) gives the gate's AUC per
    head and divergence count exactly (the same first-k episodes, ``models.meta.adapt_tasks``)."""
    from common.config import from_mapping
    from metaps.cli import build_parser
    from metaps.evaluate import overridden_meta
    from models.meta_config import MetaConfig

    rec = read_manifest(world["bundle"]).gate["adapt"]
    trained = from_mapping(MetaConfig, read_manifest(world["bundle"]).adapt["meta"], where="test")
    assert {c["recipe"]["kind"] for c in rec["candidates"]} == {"none", "offset", "inner", "inner+offset"}
    common = ["evaluate", "--bundle", str(world["bundle"]), "--data", str(world["holdout"]), "--protocol",
              "first-k", "--k", str(K), "--no-progress"]
    for c in rec["candidates"]:
        r = Recipe.from_dict(c["recipe"], "test")
        ns = build_parser().parse_args([*common, *r.evaluate_args()])
        got = overridden_meta(trained, inner_steps=ns.inner_steps, inner_lr=ns.inner_lr, inner_lr_rows=ns.inner_lr_rows,
                              offset_steps=ns.offset_steps, offset_prior=ns.offset_prior)
        assert got == r.meta(trained), r.name
    picked = ["none", "offset(4, prior 1)", "inner(1x0.01)", "inner(1x0.03)+offset(4, prior 4)",
              "inner(1x0.1)+offset(4, prior 16)"]
    for c in [c for c in rec["candidates"] if c["name"] in picked]:
        r = Recipe.from_dict(c["recipe"], "test")
        capsys.readouterr()
        assert main([*common, *r.evaluate_args()]) == 0, r.name
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert ("adapted" in report) == (r.kind != "none"), r.name
        got = report["adapted"] if r.kind != "none" else report["base"]
        assert {h: m["auc"] for h, m in got.items()} == c["auc"], r.name
        assert report.get("inner_diverged") == c.get("inner_diverged"), r.name  # the same check, the same count
    assert rec["choice_evaluate"] == Recipe.from_dict(rec["choice"], "test").evaluate_args()


def test_the_rows_rate_scales_with_the_inner_rate_and_evaluate_scores_it(world, tmp_path, capsys) -> None:
    """A bundle trained with ``[meta] inner_lr_rows``: each inner candidate scales both rates, the rows'
    rate changes the scores, and ``metaps evaluate`` with the candidate's flags scores it the same."""
    rows_rate = tmp_path / "rows" / "v000001"
    shutil.copytree(world["bundle"], rows_rate)
    man = json.loads((rows_rate / "manifest.json").read_text())
    man["adapt"]["meta"]["inner_lr_rows"] = 0.5
    del man["gate"]["adapt"]
    (rows_rate / "manifest.json").write_text(json.dumps(man))
    served = load_bundle(rows_rate)
    try:
        sel = select_recipe(served, world["holdout"], K)
    finally:
        served.close()
    inner = [s for s in sel.candidates if s.recipe.inner_steps]
    assert sorted({(r.inner_lr, r.inner_lr_rows) for r in (s.recipe for s in inner)}) == sorted(
        (0.1 * f, 0.5 * f) for f in (0.1, 0.3, 1.0))
    assert sel.configured == Recipe(1, 0.1, inner_lr_rows=0.5)
    one_rate = {c["name"]: c["auc"] for c in read_manifest(world["bundle"]).gate["adapt"]["candidates"]}
    for s in inner[:4]:  # a rate alone and with an offset
        plain_name = Recipe(s.recipe.inner_steps, s.recipe.inner_lr, s.recipe.offset_steps, s.recipe.offset_prior).name
        assert s.auc != one_rate[plain_name], s.recipe.name  # the rows moved at their own rate
        capsys.readouterr()
        assert main(["evaluate", "--bundle", str(rows_rate), "--data", str(world["holdout"]), "--protocol",
                     "first-k", "--k", str(K), "--no-progress", *s.recipe.evaluate_args()]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert report["meta"]["inner_lr_rows"] == s.recipe.inner_lr_rows
        assert {h: m["auc"] for h, m in report["adapted"].items()} == s.auc, s.recipe.name


def test_an_offset_only_configuration_ships_and_evaluates_as_the_offset_alone(world, tmp_path, capsys) -> None:
    """``[meta] inner_steps = 0, offset_steps = 4`` (the offset-only recipe): unselected, the bundle serves the
    offset alone (not "none"), and ``metaps evaluate`` with the bundle's own recipe scores it as the gate's
    ``offset(4, prior 16)`` candidate."""
    only = tmp_path / "offset-only" / "v000001"
    shutil.copytree(world["bundle"], only)
    man = json.loads((only / "manifest.json").read_text())
    man["adapt"]["meta"].update(inner_steps=0, offset_steps=4, offset_prior=16.0)
    del man["gate"]["adapt"]
    (only / "manifest.json").write_text(json.dumps(man))
    served = load_bundle(only)
    try:
        adapting = AdaptingModel(served)
        assert (adapting.recipe, adapting.recipe_from) == (Recipe(0, 0.1, 4, 16.0), "configured")
        assert not_selected(served.manifest, "why").chosen == Recipe(0, 0.1, 4, 16.0)
    finally:
        served.close()
    capsys.readouterr()
    assert main(["evaluate", "--bundle", str(only), "--data", str(world["holdout"]), "--protocol", "first-k",
                 "--k", str(K), "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gate = {c["name"]: c["auc"] for c in read_manifest(world["bundle"]).gate["adapt"]["candidates"]}
    assert {h: m["auc"] for h, m in report["adapted"].items()} == gate["offset(4, prior 16)"]
    assert "inner_diverged" not in report  # no inner step to check
