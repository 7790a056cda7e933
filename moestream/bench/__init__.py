"""`moestream bench`: streaming vs mlx-lm resident, side by side, in one run."""
