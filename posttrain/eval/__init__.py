"""Evaluation tasks. Each task is a module with a function from (model or engine, data) to a result
dataclass; `posttrain eval <task>` (posttrain/commands/eval.py) is the CLI over them.

    ppl          perplexity.py   exp(mean NLL) of held-out text
    accuracy     accuracy.py     reward >= threshold on generated answers; pass@k (pass_at_k.py)
    em-f1        em_f1.py        SQuAD exact match and token F1 of generated answers
    preference   preference.py   pairwise accuracy of a reward model or a DPO policy's implicit reward
"""

from posttrain.eval.accuracy import AccuracyResult, evaluate_accuracy
from posttrain.eval.em_f1 import EMF1Result, evaluate_em_f1, exact_match, normalize_answer, token_f1
from posttrain.eval.generation import Sampling
from posttrain.eval.pass_at_k import mean_pass_at_k, pass_at_k
from posttrain.eval.perplexity import PerplexityResult, evaluate_perplexity, perplexity
from posttrain.eval.preference import PreferenceResult, evaluate_dpo, evaluate_reward_model, pairwise_result
from posttrain.eval.prompts import EvalRows, file_rows, task_rows

__all__ = [
    "AccuracyResult",
    "EMF1Result",
    "EvalRows",
    "PerplexityResult",
    "PreferenceResult",
    "Sampling",
    "evaluate_accuracy",
    "evaluate_dpo",
    "evaluate_em_f1",
    "evaluate_perplexity",
    "evaluate_reward_model",
    "exact_match",
    "file_rows",
    "mean_pass_at_k",
    "normalize_answer",
    "pairwise_result",
    "pass_at_k",
    "perplexity",
    "task_rows",
    "token_f1",
]
