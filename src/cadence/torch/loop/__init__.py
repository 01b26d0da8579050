"""The PyTorch trainer and evaluator: the step loop behind the Trainer and Evaluator protocols."""
