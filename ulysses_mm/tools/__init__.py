"""Commands around training: verify, measure, estimate, report, demo."""
