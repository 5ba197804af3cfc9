// Shared MSL helpers for the kvmetal kernels.
