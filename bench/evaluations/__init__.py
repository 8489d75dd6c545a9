"""The evaluations: the catalogue of texts, tasks and metrics (evals), their estimators (stats), the
data readers, perplexity, the KL divergence from the FP model, lm-eval task scoring."""
