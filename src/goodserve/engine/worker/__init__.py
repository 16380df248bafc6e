"""The workers: the executor that drives them, the model runner and its inputs, the ranks' plumbing."""
