"""Stage 1, tracing: the model as an ATen fx graph with global shapes (`trace`),
rewritten into the ops the rules know (`canonical`), in both modes (`modes`)."""
