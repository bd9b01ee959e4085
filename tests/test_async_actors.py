"""``single_learner_coarse`` with ``policy.sync: false``: actors collect the next batch with parameters one
update old while the learner trains. The pipeline is deterministic: every batch is exactly one update
behind (recorded as ``policy_lag``), and threads and ray give the same parameters."""

from __future__ import annotations

import functools

import pytest
from helpers import final_params, max_diff

COARSE = ("policy.name=single_learner_coarse", "policy.actors=2", "policy.envs_per_actor=2")


@functools.lru_cache(maxsize=None)
def pipelined(*more: str):
    return final_params([*COARSE, "policy.sync=false", *more], 4)


def test_actors_act_one_update_behind_and_the_lag_is_recorded():
    sync, sync_rows = final_params(list(COARSE), 4)
    params, rows = pipelined()
    assert [r["policy_lag"] for r in sync_rows] == [0, 0, 0, 0]
    assert [r["policy_lag"] for r in rows] == [0, 1, 1, 1]
    assert sync_rows[0]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-6)  # the first batch is the same
    assert max_diff(sync, params) > 1e-4  # later ones were collected with older parameters


def test_ray_pipelines_the_same_way(ray_cluster):
    params, rows = pipelined()
    remote, remote_rows = final_params([*COARSE, "policy.sync=false", "policy.backend=ray"], 4)
    assert max_diff(params, remote) <= 1e-6
    assert [r["policy_lag"] for r in remote_rows] == [0, 1, 1, 1]
    assert [r["episodes"] for r in rows] == [r["episodes"] for r in remote_rows]
