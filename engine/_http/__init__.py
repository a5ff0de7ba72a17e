"""HTTP: the pooled transport, proxies and TLS, headers, the retry policy, and the one bounded POST with retries."""
