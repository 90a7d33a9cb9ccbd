"""Code generation: spec expressions to CUDA, and modules rendered from templates/."""
