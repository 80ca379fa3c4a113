"""Running the pipeline on a cluster of machines (the Ray backend): where each stage runs and how
it gets its weights."""
