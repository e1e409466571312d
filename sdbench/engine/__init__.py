"""The engine: the decode state, the one decode loop with its verify-and-commit step, the acceptance maths
and every metric formula. Nothing here knows a model's internals or a strategy's settings."""
