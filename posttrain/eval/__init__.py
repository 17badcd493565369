"""Evaluation tasks. Each task is a module with a function from (model, tokenizer, data) to a result
dataclass; `posttrain eval <task>` (posttrain/commands/eval.py) is the CLI over them."""

from posttrain.eval.perplexity import PerplexityResult, evaluate_perplexity, perplexity

__all__ = ["PerplexityResult", "evaluate_perplexity", "perplexity"]
