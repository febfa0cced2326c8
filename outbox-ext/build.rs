// The extension embeds ../sql (extension_sql_file!). Cargo fingerprints files outside the package
// by absolute path, so a build from another checkout (CI's) would pass for this one's: tracked
// here relative to the package instead.
fn main() {
    println!("cargo:rerun-if-changed=../sql");
}
