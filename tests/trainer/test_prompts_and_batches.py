"""The built-in addition task, the seeded prompt stream and split, exact-match rewards, JSONL and Parquet problems,
padded rollouts and the generated batch's saved state."""

import json

import pytest

from vcpo.trainer.data import PromptStream, addition_problems, load_problems, split_problems
from vcpo.trainer.rewards import exact_match, resolve_reward
from vcpo.trainer.rollouts import GeneratedBatch, Rollout, pad_rollouts


def test_addition_problems_are_correct_and_distinct():
    probs = addition_problems(500, 2, seed=3)
    assert len({p.prompt for p in probs}) == 500
    for p in probs:
        a, b = map(int, p.prompt.rstrip("=").split("+"))
        assert int(p.answer) == a + b and 0 <= a < 100 and 0 <= b < 100
    with pytest.raises(ValueError):
        addition_problems(101, 1, seed=0)


def test_prompt_stream_is_a_function_of_seed_and_batch():
    s1, s2 = PromptStream(37, seed=5), PromptStream(37, seed=5)
    batches = [s1.batch(j, 8) for j in range(20)]
    assert [s2.batch(j, 8) for j in reversed(range(20))] == list(reversed(batches))  # any order, same stream
    flat = [i for b in batches for i in b]
    for epoch in range(4):  # each epoch is a permutation: nothing repeated, nothing skipped
        assert sorted(flat[epoch * 37:(epoch + 1) * 37]) == list(range(37))
    assert PromptStream(37, seed=6).batch(0, 8) != batches[0]


def test_split_is_disjoint_and_seeded():
    probs = addition_problems(200, 2, seed=0)
    train, held = split_problems(probs, 50, seed=1)
    assert len(train) == 150 and len(held) == 50 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert split_problems(probs, 50, seed=1) == (train, held)
    with pytest.raises(ValueError, match="eval_size"):
        split_problems(probs, 200, seed=1)


def test_exact_match_and_reward_resolution():
    assert exact_match(" 42 ", "42") == 1.0 and exact_match("42 ", "43") == 0.0 and exact_match("4 2", "42") == 0.0
    assert resolve_reward(None) is exact_match
    assert resolve_reward("os.path:join") is __import__("os").path.join
    for spec, msg in [("nocolon", "module:function"), ("no_such_module_xyz:f", "cannot import"),
                      ("os:no_such_function", "no function")]:
        with pytest.raises(ValueError, match=msg):
            resolve_reward(spec)


def test_load_problems_jsonl_and_parquet(tmp_path):
    rows = [{"q": f"{i}+1=", "a": i + 1} for i in range(5)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = load_problems(str(jl), "q", "a")
    assert [(p.prompt, p.answer) for p in got] == [(r["q"], r["a"]) for r in rows]  # numbers stay numbers
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "d.parquet"))
    assert load_problems(str(tmp_path / "d.parquet"), "q", "a") == got
    with pytest.raises(ValueError, match="no field 'prompt'"):
        load_problems(str(jl), "prompt", "a")
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_problems(str(tmp_path / "bad.jsonl"), "q", "a")
    with pytest.raises(ValueError, match=".jsonl or .parquet"):
        load_problems(__file__, "q", "a")


def test_pad_rollouts_aligns_tokens_and_logprobs():
    rs = [Rollout(0, 0, 0, [1, 5, 6], [7, 2], [-0.5, -0.25], "stop", 1.0, 0),
          Rollout(0, 0, 1, [1, 5], [9, 9, 9, 2], [-1.0, -2.0, -3.0, -4.0], "stop", 0.0, 0)]
    ids, attn, loss_mask, mu = pad_rollouts(rs, pad_id=0)
    assert ids.tolist() == [[1, 5, 6, 7, 2, 0], [1, 5, 9, 9, 9, 2]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6]
    assert loss_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert mu[0, 3:5].tolist() == [-0.5, -0.25] and mu[1, 2:].tolist() == [-1.0, -2.0, -3.0, -4.0]


def test_generated_batch_round_trips():
    b = GeneratedBatch(3, 1, [Rollout(3, 4, 0, [1], [2], [-0.1], None, 0.5, 1)])
    assert GeneratedBatch.from_state(json.loads(json.dumps(b.to_state()))) == b
