"""What travels between client, router and engines: headers, bodies, SSE framing and
filters, stream resumption, and the decode legs' HTTP client. No routing decisions."""
