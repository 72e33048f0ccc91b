"""The console: the admin, its forms, the staff pages under /dashboard/ and the dashboard's history."""
