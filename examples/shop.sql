-- Source of examples/databases/shop/shop.sqlite (rebuild: sqlite3 ... < shop.sql, or python -c via sqlite3).
CREATE TABLE customer (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT, joined DATE);
CREATE TABLE product (id INTEGER PRIMARY KEY, title TEXT NOT NULL, category TEXT, price REAL);
CREATE TABLE purchase (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customer(id),
                       product_id INTEGER REFERENCES product(id), quantity INTEGER, day DATE);
INSERT INTO customer VALUES (1,'Ada','Berlin','2021-03-01'),(2,'Bo','Paris','2022-07-15'),
  (3,'Cy','Berlin',NULL),(4,'Di','Rome','2023-01-09'),(5,'Ed',NULL,'2020-11-30');
INSERT INTO product VALUES (1,'Kettle','kitchen',24.5),(2,'Lamp','home',31.0),(3,'Pan','kitchen',18.25),
  (4,'Rug','home',120.0),(5,'Mug','kitchen',6.5);
INSERT INTO purchase VALUES (1,1,1,1,'2024-01-02'),(2,1,5,4,'2024-01-02'),(3,2,2,1,'2024-02-11'),
  (4,3,4,1,'2024-03-05'),(5,4,3,2,'2024-03-06'),(6,2,5,2,'2024-04-01'),(7,5,1,1,'2024-04-09');
