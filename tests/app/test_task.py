"""The embedded arithmetic task."""

import json

import pytest

from mxrl.app.rewards import load_reward
from mxrl.app.task import ArithmeticTask, Problem
from mxrl.models.tokenizer import CharTokenizer


def test_problems_are_deterministic_given_the_seed():
    assert ArithmeticTask(3).sample(20) == ArithmeticTask(3).sample(20)
    assert ArithmeticTask(3).sample(20) != ArithmeticTask(4).sample(20)
    task = ArithmeticTask(3)
    assert task.sample(5) + task.sample(5) == ArithmeticTask(3).sample(10)  # a stream


def test_train_and_eval_never_overlap():
    task = ArithmeticTask(0, max_operand=30, ops="+-*")
    evals = task.eval_problems()
    assert len(evals) == task.eval_size == len(set(evals))
    assert evals == ArithmeticTask(0, max_operand=30, ops="+-*").eval_problems()
    train = set(task.sample(2000)) | {ex.problem for ex in task.supervised_examples(500)}
    assert not train & set(evals)
    assert all(task.is_eval(p) for p in evals) and not any(task.is_eval(p) for p in train)


def test_problem_text_answer_and_char_tokenizer():
    task = ArithmeticTask(0, max_operand=99, ops="+-*")
    tok = CharTokenizer()
    for p in task.sample(200):
        assert 0 <= p.a <= 99 and 0 <= p.b <= 99 and p.op in "+-*"
        assert p.prompt == f"{p.a}{p.op}{p.b}=" and p.label == str(p.answer)
        ids = task.encode_prompt(p)
        assert ids[0] == tok.bos_token_id and tok.decode(ids) == p.prompt
        assert len(tok.encode(p.label)) + 1 <= task.max_new_tokens
    assert Problem(12, "+", 7).answer == 19 and Problem(3, "-", 5).answer == -2
    assert ArithmeticTask(0, max_operand=99, ops="+-*").max_new_tokens == len("9801") + 1
    assert ArithmeticTask(0, max_operand=20, ops="+-").max_new_tokens == len("-20") + 1


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("19", 1.0),
        ("19<eos>", 1.0),  # decoded with specials kept
        ("19 and more", 1.0),  # up to the first non-digit
        ("+19", 1.0),
        ("190", 0.0),
        (" 19", 0.0),  # the answer must follow '=' directly
        ("", 0.0),
        ("abc", 0.0),
        ("1", 0.0),
    ],
)
def test_reward_is_an_exact_leading_integer_match(response, reward):
    task = ArithmeticTask(0)
    assert task.reward(response, Problem(12, "+", 7)) == reward
    assert load_reward("integer")(response, Problem(12, "+", 7).label) == reward


def test_negative_answers():
    task = ArithmeticTask(0)
    p = Problem(3, "-", 5)
    assert task.reward("-2", p) == 1.0 and task.reward("2", p) == 0.0
    assert task.reward("--2", p) == 0.0


def test_supervised_examples():
    task = ArithmeticTask(1)
    tok = task.tokenizer
    for ex in task.supervised_examples(20):
        assert ex.prompt_ids == task.encode_prompt(ex.problem)
        assert ex.completion_ids[-1] == tok.eos_token_id
        assert tok.decode(ex.tokens) == ex.problem.prompt + ex.problem.label
        assert len(ex.loss_mask) == len(ex.tokens) - 1
        targets = [t for t, m in zip(ex.tokens[1:], ex.loss_mask, strict=True) if m]
        assert targets == ex.completion_ids
        assert task.reward(tok.decode(ex.completion_ids), ex.problem) == 1.0


def test_state_round_trip():
    a = ArithmeticTask(5)
    a.sample(7)
    a.supervised_examples(3)
    b = ArithmeticTask(5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert a.sample(10) == b.sample(10)
    assert a.supervised_examples(4) == b.supervised_examples(4)
    with pytest.raises(ValueError, match="seed=5"):
        ArithmeticTask(6).load_state_dict(a.state_dict())


def test_config_errors():
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(0, ops="+/")
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticTask(0, max_operand=0)
    with pytest.raises(ValueError, match="eval_size"):
        ArithmeticTask(0, max_operand=5, eval_size=32)


def test_decode_response_stops_at_eos_and_tolerates_unknown_ids():
    task = ArithmeticTask(0)
    tok = task.tokenizer
    ids = [*tok.encode("19"), tok.eos_token_id, *tok.encode("7")]
    assert task.decode_response(ids) == "19"
    assert task.decode_response([*tok.encode("19"), 63, *tok.encode("5")]) == "19\ufffd5"
    assert task.reward(task.decode_response([*tok.encode("19"), 63]), Problem(12, "+", 7)) == 1.0


def test_tasks_sharing_a_split_share_the_held_out_set():
    """The demo's warm-up and RL seeds: own train streams, one split, one eval set."""
    kw = dict(max_operand=20, eval_fraction=0.25, eval_size=100, split_seed=0)
    warm, rl = ArithmeticTask(0, **kw), ArithmeticTask(2, **kw)
    assert warm.eval_problems() == rl.eval_problems() and len(set(rl.eval_problems())) == 100
    assert warm.sample(50) != rl.sample(50)
    held = set(rl.eval_problems())
    seen = {e.problem for e in warm.supervised_examples(2000)} | set(rl.sample(2000))
    assert not seen & held
    assert ArithmeticTask(2).eval_problems() != ArithmeticTask(0).eval_problems()  # own split


def test_fresh_keeps_the_settings_and_restarts_the_streams():
    task = ArithmeticTask(3, max_operand=30, eval_fraction=0.2, eval_size=40, split_seed=9)
    first = task.sample(5)
    fresh = task.fresh()
    assert fresh.sample(5) == first
    assert fresh.eval_problems() == task.eval_problems()
    assert fresh.state_dict()["split_seed"] == 9


def test_a_state_without_split_seed_loads_as_split_by_its_seed():
    a = ArithmeticTask(5)
    a.sample(3)
    old = {k: v for k, v in a.state_dict().items() if k != "split_seed"}
    b = ArithmeticTask(5)
    b.load_state_dict(old)
    assert a.sample(4) == b.sample(4)
    with pytest.raises(ValueError, match="split_seed"):
        ArithmeticTask(5, split_seed=1).load_state_dict(old)
