# Written by CMakeLists.txt at build time.
MLX_VERSION = "0.32.4"
