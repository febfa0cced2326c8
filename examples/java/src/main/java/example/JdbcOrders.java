package example;

import java.math.BigDecimal;
import java.sql.Connection;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;

/** An order and its outbox event with plain JDBC, in the caller's transaction. */
final class JdbcOrders {
    private JdbcOrders() {}

    static final String SCHEMA = """
            CREATE TABLE IF NOT EXISTS orders (
              id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
              order_no text NOT NULL UNIQUE,
              customer text NOT NULL,
              total numeric(10,2) NOT NULL,
              created_at timestamptz NOT NULL DEFAULT now()
            )""";

    static final String INSERT_ORDER =
            "INSERT INTO orders (order_no, customer, total) VALUES (?, ?, ?) RETURNING id";

    /**
     * Named arguments; pgjdbc sends strings as varchar, so the JSON text gets an explicit
     * {@code ::jsonb} (here the payload is built by PostgreSQL itself, no JSON library needed).
     */
    static final String ENQUEUE = """
            SELECT outbox_enqueue(
              topic      => ?,
              payload    => jsonb_build_object('order_id', ?::bigint, 'order_no', ?::text,
                                               'customer', ?::text, 'total', ?::numeric),
              key        => ?,
              event_type => ?)""";

    /** Inserts the order and enqueues its OrderCreated event; returns the outbox id. */
    static long placeOrder(Connection c, String topic, String orderNo, String customer, BigDecimal total)
            throws SQLException {
        long orderId;
        try (PreparedStatement ps = c.prepareStatement(INSERT_ORDER)) {
            ps.setString(1, orderNo);
            ps.setString(2, customer);
            ps.setBigDecimal(3, total);
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                orderId = rs.getLong(1);
            }
        }
        try (PreparedStatement ps = c.prepareStatement(ENQUEUE)) {
            ps.setString(1, topic);
            ps.setLong(2, orderId);
            ps.setString(3, orderNo);
            ps.setString(4, customer);
            ps.setBigDecimal(5, total);
            ps.setString(6, orderNo);
            ps.setString(7, "OrderCreated");
            try (ResultSet rs = ps.executeQuery()) {
                rs.next();
                return rs.getLong(1);
            }
        }
    }
}
