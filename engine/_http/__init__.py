"""HTTP: the pooled transport, proxies and TLS, headers, and the retry policy."""
