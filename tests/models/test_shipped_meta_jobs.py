"""The shipped meta-learning jobs train a base as good as the plain one (issue 29 items 3 and 5).

G-Meta's outer loss sees only each task's query rows; the shipped jobs (``configs/*.toml`` with
``[train] mode = "meta"``) add the base model's own support loss (``[meta] support_loss_weight``),
so the base learns from every row as a plain model does. Measured with ``bench.quality --rows
200000 --cold-only --seeds 3,4,5 --inner-steps 1 --learn-inner-lr off --first-k 8``: meta base -
plain base on held-out users >= -0.0015 AUC on both heads and every seed with w = 1, down to -0.0083
(conversion) with w = 0 (the figures are in the configs' comments). ``MetaConfig``'s default stays
0, the published objective the reference tests check; this test keeps the shipped jobs from
silently falling back to it.
"""

from __future__ import annotations

from pathlib import Path

from metaps.job import load_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
JOB_FILES = sorted(p for p in CONFIGS.glob("*.toml") if "[train]" in p.read_text())


def test_every_shipped_meta_job_trains_the_base_on_the_support_rows() -> None:
    jobs = {p.name: load_job(p) for p in JOB_FILES}
    meta = {name: job for name, job in jobs.items() if job.train.mode == "meta"}
    assert set(meta) >= {"main_job.toml", "local.toml"}, sorted(jobs)
    wrong = {name: job.meta.support_loss_weight for name, job in meta.items() if job.meta.support_loss_weight != 1.0}
    assert not wrong, (f"[meta] support_loss_weight, expected 1.0 (w = 0 costs the meta base up to 0.008 "
                       f"conversion AUC against the plain base): {wrong}")
