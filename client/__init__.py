"""The volunteer's application: commands, hardware, data and the training loop."""
