"""The forward passes: weights, layers, MLA attention, MoE, latent cache, the target and the DFlash drafter."""
