"""What operators run: admin routes (purges, ownership), the dashboard, the cluster launcher, the sweeper, the purge feed between replicas, what-if replays."""
