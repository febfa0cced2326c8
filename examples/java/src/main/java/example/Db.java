package example;

import java.net.URI;

/** Connection settings shared by the examples. */
final class Db {
    private Db() {}

    /**
     * A JDBC URL from {@code jdbc:postgresql://...} (kept as is) or from a libpq-style
     * {@code postgresql://user:password@host:port/dbname} URL (what the other examples take).
     */
    static String jdbcUrl(String url) {
        if (url.startsWith("jdbc:")) {
            return url;
        }
        URI u = URI.create(url);
        if (!"postgresql".equals(u.getScheme()) && !"postgres".equals(u.getScheme())) {
            throw new IllegalArgumentException("expected jdbc:postgresql:// or postgresql:// URL, got " + url);
        }
        StringBuilder jdbc = new StringBuilder("jdbc:postgresql://").append(u.getHost());
        if (u.getPort() > 0) {
            jdbc.append(':').append(u.getPort());
        }
        jdbc.append(u.getRawPath() == null || u.getRawPath().isEmpty() ? "/" : u.getRawPath());
        String sep = "?";
        if (u.getRawUserInfo() != null) {
            String[] userPass = u.getRawUserInfo().split(":", 2);
            jdbc.append(sep).append("user=").append(userPass[0]);
            sep = "&";
            if (userPass.length == 2) {
                jdbc.append(sep).append("password=").append(userPass[1]);
            }
        }
        if (u.getRawQuery() != null) {
            jdbc.append(sep).append(u.getRawQuery());
        }
        return jdbc.toString(); // percent-encoded user or password: pgjdbc decodes them
    }

    /** The first argument, else the environment variable, else a usage error. */
    static String arg(String[] args, int i, String env, String usage) {
        if (args.length > i) {
            return args[i];
        }
        String v = System.getenv(env);
        if (v == null || v.isEmpty()) {
            System.err.println(usage);
            System.exit(2);
        }
        return v;
    }

    static String env(String name, String fallback) {
        String v = System.getenv(name);
        return v == null || v.isEmpty() ? fallback : v;
    }
}
