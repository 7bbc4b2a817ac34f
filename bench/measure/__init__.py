"""The measuring kit benchmarks and experiments share: workloads, the load generator, text
for token workloads, reports and plots, and the common timing, targets and JSON output."""
