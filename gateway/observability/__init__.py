"""What operators read: the per-request trace, Prometheus metrics, request logs, diagnosis and the stats behind them."""
