"""Django's PostgreSQL backend, with its connection pool's connections checked at checkout so
that a server restart costs no request an error or a wait (`base.DatabaseWrapper`)."""
