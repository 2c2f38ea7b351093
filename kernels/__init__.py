"""shoal.kernels: compression kernels (Pallas on GPU, a jnp reference everywhere)."""
