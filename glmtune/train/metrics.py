"""Generation metrics as the official GLM-4 fine-tune demo reports them: ROUGE-1/2/L, BLEU-4, plus exact match.

The demo (finetune_demo/finetune.py, `compute_metrics`) segments prediction and reference with jieba, scores
ROUGE with the `rouge_chinese` package on the space-joined words and BLEU-4 with nltk's `sentence_bleu`
(smoothing method 3), then averages over examples. The same arithmetic is written out here so that a run
needs neither package (nltk alone is ~10 MB) and an empty prediction scores 0 instead of raising:

- words: jieba's tokens of the stripped text, whitespace tokens dropped (rouge_chinese splits on spaces);
- ROUGE-N (N = 1, 2): over the *sets* of distinct N-grams (rouge_chinese's default `exclusive=True`),
  p = |common| / |hyp set|, r = |common| / |ref set|, f = 2pr / (p + r + 1e-8); reported x 100;
- ROUGE-L: LCS of the two word sequences, p = lcs / len(hyp), r = lcs / len(ref), same f; x 100;
- BLEU-4: clipped n-gram precisions for n = 1..4 with weights 1/4, a precision with no match replaced by
  1 / (2^k x its denominator) for the k-th such order (NIST geometric smoothing), times the brevity
  penalty exp(1 - ref/hyp) when hyp is shorter; 0 when no unigram matches. Reported as a fraction in
  [0, 1], as the demo does (it multiplies ROUGE by 100 but not BLEU);
- BLEU uses the jieba words *with* whitespace tokens, exactly the lists the demo passes to nltk.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

EPS = 1e-8  # rouge_chinese's guard in f = 2pr / (p + r + eps)


def segment(text: str) -> list[str]:
    """jieba's words of the text (Chinese segmented, English split on spaces and punctuation)."""
    import jieba

    jieba.setLogLevel(logging.WARNING)  # otherwise it prints its dictionary-loading banner on every run
    return list(jieba.cut(text.strip()))


def _f1(p: float, r: float) -> float:
    return 2.0 * p * r / (p + r + EPS)


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def rouge_n(hyp: list[str], ref: list[str], n: int) -> float:
    """F-score of ROUGE-N over distinct n-grams, in [0, 1]."""
    h, r = set(_ngrams(hyp, n)), set(_ngrams(ref, n))
    common = len(h & r)
    return _f1(common / len(h) if h else 0.0, common / len(r) if r else 0.0)


def lcs_length(a: list[str], b: list[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, start=1):
            prev_diag, row[j] = row[j], prev_diag + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(hyp: list[str], ref: list[str]) -> float:
    if not hyp or not ref:
        return 0.0
    lcs = lcs_length(hyp, ref)
    return _f1(lcs / len(hyp), lcs / len(ref))


def bleu4(hyp: list[str], ref: list[str]) -> float:
    """Sentence BLEU-4 against one reference, smoothing method 3, in [0, 1]."""
    if not hyp:
        return 0.0
    precisions, k = [], 1
    for n in range(1, 5):
        counts, ref_counts = Counter(_ngrams(hyp, n)), Counter(_ngrams(ref, n))
        matched = sum(min(c, ref_counts[g]) for g, c in counts.items())
        total = max(1, sum(counts.values()))
        if n == 1 and matched == 0:
            return 0.0
        if matched == 0:
            precisions.append(1.0 / (2**k * total))
            k += 1
        else:
            precisions.append(matched / total)
    penalty = 1.0 if len(hyp) > len(ref) else math.exp(1 - len(ref) / len(hyp))
    return penalty * math.exp(sum(0.25 * math.log(p) for p in precisions))


def score_one(prediction: str, reference: str) -> dict[str, float]:
    pred_words, ref_words = segment(prediction), segment(reference)
    hyp, ref = [w for w in pred_words if w.strip()], [w for w in ref_words if w.strip()]
    return {
        "rouge-1": 100 * rouge_n(hyp, ref, 1),
        "rouge-2": 100 * rouge_n(hyp, ref, 2),
        "rouge-l": 100 * rouge_l(hyp, ref),
        "bleu-4": bleu4(pred_words, ref_words),
        "exact_match": float(prediction.strip() == reference.strip()),
    }


def generation_metrics(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean of each metric over the examples (the demo's np.mean); exact match as a fraction."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need as many predictions as references (>0), got {len(predictions)}, {len(references)}")
    scores = [score_one(p, r) for p, r in zip(predictions, references)]
    return {key: sum(s[key] for s in scores) / len(scores) for key in scores[0]}
