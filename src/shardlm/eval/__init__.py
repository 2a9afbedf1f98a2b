"""Evaluation of a trained model directory: perplexity over a text file or corpus, data-parallel
over ranks."""

from shardlm.eval.perplexity import (
    EvalResult,
    context_windows,
    evaluate_model,
    evaluate_tokens,
    strided_windows,
    token_stream,
)

__all__ = ["EvalResult", "context_windows", "evaluate_model", "evaluate_tokens", "strided_windows",
           "token_stream"]
