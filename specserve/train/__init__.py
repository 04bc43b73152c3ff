"""Training EAGLE-3 draft heads for a specserve target (`specserve train-draft`)."""
