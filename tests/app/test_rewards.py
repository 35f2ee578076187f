"""Reward functions, with real math-verify comparisons."""

import threading

import pytest

from mxrl.app.rewards import (
    exact_match_reward,
    integer_reward,
    last_boxed,
    load_reward,
    math_reward,
)


@pytest.mark.parametrize(
    ("text", "inner"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{a}{b}}", r"\frac{a}{b}"),  # nested braces
        (r"\boxed{1} then \boxed{2}", "2"),  # the last one wins
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are characters
        (r"\fbox{7}", "7"),
        (r"the answer is \boxed 5$.", "5"),
        (r"\boxed{\frac{1}{2}", None),  # truncated: not closed
        ("no answer here", None),
        (r"\boxed", None),
    ],
)
def test_last_boxed(text, inner):
    assert last_boxed(text) == inner


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (r"The answer is \boxed{0.5}.", "1/2", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{a}{b}}", r"\frac{a}{b}", 1.0),
        (r"\boxed{1+x^2}", "x^2+1", 1.0),
        (r"first \boxed{3}, finally \boxed{4}", "4", 1.0),
        (r"first \boxed{3}, finally \boxed{4}", "3", 0.0),
        (r"\boxed{34}", 34, 1.0),  # an integer label from JSON
        (r"\boxed{35}", "34", 0.0),
        ("The answer is 34", "34", 0.0),  # no boxed answer
        (r"\boxed{}", "0", 0.0),
    ],
)
def test_math_reward(response, label, reward):
    assert math_reward(response, label) == reward


@pytest.mark.parametrize(
    "garbage",
    [r"\boxed{{{", r"\boxed{\frac{}{}}", r"\boxed{\sqrt[}", "\x00\\boxed{\ud800}", r"\boxed{)(}"],
)
def test_math_reward_never_raises(garbage):
    assert math_reward(garbage, "1") == 0.0
    assert math_reward(r"\boxed{1}", garbage) in (0.0, 1.0)


def test_math_reward_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{0.5}", "1/2")))
    t.start()
    t.join()
    assert out == [1.0]


def test_exact_match_and_integer_rewards():
    assert exact_match_reward("  42\n", "42") == 1.0
    assert exact_match_reward("42.", "42") == 0.0
    assert integer_reward("19abc", 19) == 1.0 and integer_reward("-3<eos>", "-3") == 1.0
    assert integer_reward("190", 19) == 0.0 and integer_reward("", 1) == 0.0
    assert integer_reward("5", "five") == 0.0


def test_load_reward_by_name_and_path():
    assert load_reward("math") is math_reward
    assert load_reward("exact_match") is exact_match_reward
    assert load_reward("mxrl.app.rewards:exact_match_reward") is exact_match_reward
    assert load_reward("mxrl.app.rewards.integer_reward") is integer_reward


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("nonsense", "unknown reward 'nonsense'"),
        ("no_such_pkg.mod:fn", "cannot import module 'no_such_pkg.mod'"),
        ("mxrl.app.rewards:nope", "has no attribute 'nope'"),
        ("mxrl.app.rewards:BUILTIN_REWARDS", "is not callable"),
    ],
)
def test_load_reward_errors_name_the_path(name, match):
    with pytest.raises(ValueError, match=match):
        load_reward(name)
