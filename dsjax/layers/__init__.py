"""The V4-family layers as pure functions: weights, config and activations in, activations out."""
