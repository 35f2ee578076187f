"""The ablation's multi-step arithmetic task: hand-written answers, splits, tokens, resume."""

import json

import pytest

from mxrl.app.multistep import Expression, MultiStepTask, evaluate
from mxrl.app.sources import TaskSource
from mxrl.models.tokenizer import CharTokenizer


@pytest.mark.parametrize(
    ("prompt", "operands", "ops", "answer"),
    [
        ("7*8-12=", (7, 8, 12), ("*", "-"), 44),
        ("3+4*5=", (3, 4, 5), ("+", "*"), 23),  # multiplication first
        ("2-9-4=", (2, 9, 4), ("-", "-"), -11),  # left to right
        ("0-12*12=", (0, 12, 12), ("-", "*"), -144),
        ("12*12*12=", (12, 12, 12), ("*", "*"), 1728),
        ("10-3+6=", (10, 3, 6), ("-", "+"), 13),
        ("5*0+9=", (5, 0, 9), ("*", "+"), 9),
        ("6-2*3=", (6, 2, 3), ("-", "*"), 0),
    ],
)
def test_answers_by_hand(prompt, operands, ops, answer):
    p = Expression(operands, ops)
    assert p.prompt == prompt and p.answer == answer and p.label == str(answer)
    assert evaluate(operands, ops) == answer
    task = MultiStepTask(0)
    assert task.reward(str(answer), p) == 1.0
    assert task.reward(f"{answer}<eos>", p) == 1.0
    assert task.reward(str(answer + 1), p) == 0.0
    assert task.reward(str(answer) + "1", p) == 0.0  # a longer number
    assert task.reward("", p) == 0.0


def test_the_eval_dev_and_train_splits_are_disjoint():
    task = MultiStepTask(1, split_seed=0)
    evals, devs = set(task.eval_problems()), set(task.dev_problems())
    assert len(evals) == len(devs) == task.eval_size == 200
    assert not evals & devs
    trained = set(task.sample(3000)) | {e.problem for e in task.supervised_examples(3000)}
    assert not trained & (evals | devs)
    assert all(task.is_test(p) for p in evals) and not any(task.is_test(p) for p in devs)
    # another seed on the same split: its own train stream, the same held-out sets
    other = MultiStepTask(2, split_seed=0)
    assert other.eval_problems() == task.eval_problems()
    assert other.dev_problems() == task.dev_problems()
    assert other.sample(20) != MultiStepTask(1, split_seed=0).sample(20)


def test_draws_are_deterministic_and_resume_from_the_state():
    a = MultiStepTask(5)
    assert a.sample(10) == MultiStepTask(5).sample(10)
    a.supervised_examples(3)
    b = MultiStepTask(5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert a.sample(10) == b.sample(10)
    assert a.supervised_examples(4) == b.supervised_examples(4)
    with pytest.raises(ValueError, match="num_operands"):
        MultiStepTask(5, num_operands=2).load_state_dict(a.state_dict())
    assert a.fresh().sample(5) == MultiStepTask(5).sample(5)


def test_tokens_round_trip_and_the_answer_fits():
    task = MultiStepTask(0)
    tok = CharTokenizer()
    assert task.max_new_tokens == len("1728") + 1
    for ex in task.supervised_examples(300):
        p = ex.problem
        assert all(0 <= x <= 12 for x in p.operands) and len(p.ops) == 2
        assert ex.prompt_ids[0] == tok.bos_token_id and tok.decode(ex.prompt_ids) == p.prompt
        assert tok.decode(ex.completion_ids) == p.label
        assert len(ex.completion_ids) <= task.max_new_tokens
        assert task.reward(task.decode_response(ex.completion_ids), p) == 1.0
    source = TaskSource(task)
    batch = source.eval_batch()
    assert len(batch.prompts) == 200
    answer = [*tok.encode(batch.labels[0].label), tok.eos_token_id]
    assert source.reward(answer, batch.labels[0]) == 1.0


def test_config_errors():
    with pytest.raises(ValueError, match="num_operands"):
        MultiStepTask(0, num_operands=1)
    with pytest.raises(ValueError, match="eval_fraction"):
        MultiStepTask(0, eval_fraction=0.5)
    with pytest.raises(ValueError, match="eval_size"):
        MultiStepTask(0, max_operand=2, eval_size=100)
    with pytest.raises(ValueError, match="ops"):
        MultiStepTask(0, ops="+/")
