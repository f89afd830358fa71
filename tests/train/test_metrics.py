"""Generation metrics against values worked out by hand (and, where installed, the demo's own packages)."""

import math

import pytest

from glmtune.train.metrics import bleu4, generation_metrics, lcs_length, rouge_l, rouge_n, score_one, segment


def test_chinese_by_hand():
    # jieba: 我/爱/北京/天安门 vs 我/爱/北京/的/天安门广场
    assert segment("我爱北京天安门") == ["我", "爱", "北京", "天安门"]
    s = score_one("我爱北京天安门", "我爱北京的天安门广场")
    # ROUGE-1: 3 common of 4 hyp / 5 ref words: p=3/4 r=3/5 f=2*0.45/1.35
    assert s["rouge-1"] == pytest.approx(100 * 2 / 3, abs=1e-5)
    # ROUGE-2: bigrams hyp {我爱, 爱北京, 北京天安门}, ref {我爱, 爱北京, 北京的, 的天安门广场}: p=2/3 r=1/2 f=4/7
    assert s["rouge-2"] == pytest.approx(100 * 4 / 7, abs=1e-5)
    # ROUGE-L: LCS 我 爱 北京 = 3 -> same p, r as ROUGE-1
    assert s["rouge-l"] == pytest.approx(100 * 2 / 3, abs=1e-5)
    # BLEU-4: p1=3/4 p2=2/3 p3=1/2 (我爱北京 matches), p4 no match -> 1/(2^1 * 1); BP exp(1 - 5/4)
    assert s["bleu-4"] == pytest.approx(math.exp(-0.25) * (3 / 4 * 2 / 3 * 1 / 2 * 1 / 2) ** 0.25, rel=1e-12)
    assert s["exact_match"] == 0.0


def test_english_by_hand():
    s = score_one("the cat sat on the mat", "the cat is on the mat")
    assert s["rouge-1"] == pytest.approx(80.0, abs=1e-5)  # distinct words: 4 common of 5 and 5
    assert s["rouge-2"] == pytest.approx(60.0, abs=1e-5)  # distinct bigrams: 3 common of 5 and 5
    assert s["rouge-l"] == pytest.approx(100 * 5 / 6, abs=1e-5)  # LCS the cat on the mat = 5 of 6 and 6
    # BLEU counts jieba's space tokens as the demo does: 11 tokens each side; matches 10/11, 8/10, 6/9, 4/8
    assert s["bleu-4"] == pytest.approx((10 / 11 * 8 / 10 * 6 / 9 * 4 / 8) ** 0.25, rel=1e-12)


def test_edges():
    assert score_one(" 答案 ", "答案")["exact_match"] == 1.0
    assert score_one("", "something")["rouge-1"] == 0.0 and bleu4([], ["a"]) == 0.0  # the demo raises here
    assert bleu4(["x"], ["y"]) == 0.0  # no unigram match
    # a short hypothesis: p1=1/1, p2..p4 have no n-gram at all -> 1/2, 1/4, 1/8; BP exp(1 - 5)
    assert bleu4(["a"], list("abcde")) == pytest.approx(math.exp(-4) * (1 / 2 * 1 / 4 * 1 / 8) ** 0.25)
    assert lcs_length(list("abcbdab"), list("bdcaba")) == 4
    assert rouge_n(["a", "a", "b"], ["a", "b"], 1) == pytest.approx(1.0, abs=1e-7)  # sets: repeats count once
    assert rouge_l(["a"], []) == 0.0
    m = generation_metrics(["a b", "c"], ["a b", "d"])
    assert m["exact_match"] == 0.5 and m["rouge-1"] == pytest.approx(50.0, abs=1e-5)
    with pytest.raises(ValueError):
        generation_metrics([], [])


PAIRS = [
    ("今天天气很好。我们去公园吧！", "今天天气不错，我们去公园。"),
    ("Paris is the capital of France.", "The capital of France is Paris."),
    ("x y", "z w"),
    ("a", "a b c d e"),
    ("我爱北京天安门", "我爱北京的天安门广场"),
]


def test_same_numbers_as_the_demo_packages():
    """The demo's compute_metrics, with rouge_chinese and nltk, where they are installed."""
    rouge_chinese = pytest.importorskip("rouge_chinese")
    bleu = pytest.importorskip("nltk.translate.bleu_score")
    for pred, ref in PAIRS:
        pt, lt = segment(pred), segment(ref)
        want = rouge_chinese.Rouge().get_scores(" ".join(pt), " ".join(lt))[0]
        got = score_one(pred, ref)
        for key in ("rouge-1", "rouge-2", "rouge-l"):
            assert got[key] == pytest.approx(want[key]["f"] * 100, abs=1e-5), (pred, key)
        assert got["bleu-4"] == pytest.approx(
            bleu.sentence_bleu([lt], pt, smoothing_function=bleu.SmoothingFunction().method3), rel=1e-9
        )
